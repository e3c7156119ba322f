"""Speculative sampling at temperature > 0: drafts drawn from the drafter's q, kept or replaced against the target's p.

Owns the lossless rule (Leviathan et al. 2023, Chen et al. 2023). Draft k is drawn from q_k,
the drafter's logits processed exactly as the target's are (penalties as `adjust_logits`
applies them, then temperature, top-k, top-p, min-p); it is accepted with probability
min(1, p_k(x) / q_k(x)); at the first rejected position the emitted token is drawn from
norm(max(0, p_k − q_k)), and a block whose drafts all pass emits a bonus token from p at its
last position. Each emitted token then has exactly the target's distribution given the tokens
before it. `propose` draws one block's drafts; `accept` decides many blocks at once, a pure
function of the probabilities and uniforms `draw_uniforms` takes from each request's own
generator (so a seeded request draws the same numbers whatever it is batched with).
Greedy requests never come here: their drafts are the drafter's argmax, their tokens the
target's. This module does not touch sessions or caches.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pdflash.sampling import SamplingParams, adjust_logits, probabilities


def propose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Collection[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[d, V] drafter logits → ([d] drafted ids, [d, V] the q each was drawn from, or None when greedy).

    Row j predicts the token after the block's j-th token, so it is penalized with the drafts
    before it (the same history `adjust_logits` gives the verify's row j); with penalties the
    rows are therefore drawn one after another. Draws use `generator`, on its device.
    """
    if params.greedy:
        return logits.argmax(dim=-1), None
    if generator is None:
        raise ValueError(f"a sampled request (temperature {params.temperature}) needs a generator, got None")
    logits = logits.to(generator.device)
    if not params.penalized:
        q = probabilities(logits, params)  # [d, V]
        return torch.multinomial(q, 1, generator=generator).squeeze(-1), q
    drafts: list[int] = []
    rows = []
    for j in range(logits.shape[0]):
        row = adjust_logits(
            logits[: j + 1], params, prompt_ids=prompt_ids, output_ids=output_ids, drafted=drafts, stop_ids=stop_ids
        )[j:]  # [1, V]
        q_j = probabilities(row, params)  # [1, V]
        drafts.append(int(torch.multinomial(q_j, 1, generator=generator)))
        rows.append(q_j)
    q = torch.cat(rows) if rows else torch.empty(0, logits.shape[-1], device=logits.device)  # [d, V]
    return torch.tensor(drafts, dtype=torch.int64, device=logits.device), q


def accept_blocks(
    target_probs: Sequence[torch.Tensor],
    draft_probs: Sequence[torch.Tensor | None],
    drafts: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[int]]:
    """Blocks of different lengths b_i, decided in one `accept` → (drafts accepted, the token after them) each.

    target_probs[i] [b_i, V]; draft_probs[i] [b_i - 1, V], or None for drafts chosen without a
    distribution (a block set by hand), which count as point masses, also lossless; drafts[i]
    [b_i - 1]; uniforms come from generators[i]. The blocks are padded to the longest.
    """
    n, width = len(target_probs), max(int(p.shape[0]) for p in target_probs)
    device, vocab = target_probs[0].device, target_probs[0].shape[-1]
    if any(g is None for g in generators):
        raise ValueError("every sampled block needs its request's generator (SamplingParams.generator), got None")
    p_all = torch.zeros(n, width, vocab, device=device)  # [n, b, V]
    q_all = torch.zeros(n, width - 1, vocab, device=device)  # [n, b-1, V]
    ids = torch.zeros(n, width - 1, dtype=torch.int64, device=device)  # [n, b-1]
    counts = [int(x.numel()) for x in drafts]
    for i, (p, q, x, count) in enumerate(zip(target_probs, draft_probs, drafts, counts, strict=True)):
        x = x.to(device)
        q = torch.nn.functional.one_hot(x, vocab).to(p) if q is None else q.to(device)  # [count, V]
        p_all[i, : count + 1], q_all[i, :count], ids[i, :count] = p, q, x
    test_u, resample_u = draw_uniforms([g for g in generators if g is not None], counts, device)
    accepted, tokens = accept(p_all, q_all, ids, torch.tensor(counts, device=device), test_u, resample_u)
    return accepted.tolist(), tokens.tolist()


def draw_uniforms(
    generators: Sequence[torch.Generator], draft_counts: Sequence[int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ ([n, max count] acceptance uniforms, [n] resampling uniforms), each row from its own generator.

    Sequence i draws exactly draft_counts[i] + 1 numbers (its tests, then its resample) whatever
    the rest of the batch is; entries past its count are padding (1.0) that `accept` ignores.
    """
    width = max(draft_counts, default=0)
    tests = torch.ones(len(generators), width, device=device)  # [n, d]
    resample = torch.empty(len(generators), device=device)  # [n]
    for i, (generator, count) in enumerate(zip(generators, draft_counts, strict=True)):
        u = torch.rand(count + 1, generator=generator, device=generator.device).to(device)  # [count + 1]
        tests[i, :count], resample[i] = u[:count], u[count]
    return tests, resample


def accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_counts: torch.Tensor,
    test_u: torch.Tensor,
    resample_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide n blocks of up to d = b - 1 drafts at once → ([n] drafts accepted, [n] the token after them).

    target_probs [n, b, V]: p at each block position (row k: the token after the block's k-th
        token, i.e. the distribution of draft k); rows past a sequence's count + 1 are ignored.
    draft_probs [n, d, V]: the q draft k was drawn from; rows past a sequence's count are ignored.
    drafts [n, d]: drafted ids (padding past a sequence's count must still be valid ids, e.g. 0).
    draft_counts [n]: drafts in each sequence's block (0 … d).
    test_u [n, d], resample_u [n]: independent uniforms in [0, 1) (`draw_uniforms`).
    """
    n, b, vocab = target_probs.shape
    d = b - 1
    if draft_probs.shape != (n, d, vocab) or drafts.shape != (n, d) or test_u.shape != (n, d):
        raise ValueError(
            f"with target_probs {tuple(target_probs.shape)} draft_probs must be {(n, d, vocab)}, drafts and test_u "
            f"{(n, d)}; got {tuple(draft_probs.shape)}, {tuple(drafts.shape)}, {tuple(test_u.shape)}"
        )
    rows = torch.arange(n, device=target_probs.device)  # [n]
    valid = torch.arange(d, device=target_probs.device) < draft_counts[:, None]  # [n, d]
    p_x = target_probs[:, :d].gather(-1, drafts[..., None]).squeeze(-1)  # [n, d] p_k(draft k)
    q_x = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)  # [n, d] q_k(draft k)
    passed = (test_u * q_x < p_x) & valid  # [n, d] u < p/q, without dividing by q
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # [n] leading passes
    p_at = target_probs[rows, accepted]  # [n, V]
    if d:
        rejected = (accepted < draft_counts)[:, None]  # [n, 1] False: all passed, a bonus from p
        q_at = torch.where(rejected, draft_probs[rows, accepted.clamp(max=d - 1)], 0.0)  # [n, V]
        residual = (p_at - q_at).clamp(min=0.0)  # [n, V] max(0, p − q); p itself for a bonus
    else:
        residual = p_at
    # mass 0 only when p ≤ q everywhere, where a rejection has probability 0 (float noise): p then
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
    return accepted, _inverse_cdf(residual, resample_u)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n, V] non-negative weights (each row with positive mass), [n] uniforms in [0, 1) → [n] ids ∝ weights.

    In float64, so u × mass stays below the total and the id found always has positive weight.
    """
    cumulative = weights.double().cumsum(dim=-1)  # [n, V]
    point = u.double() * cumulative[:, -1]  # [n]
    return torch.searchsorted(cumulative, point[:, None], right=True).squeeze(-1)  # [n] first id with cdf > point
