"""Sampling parameters (validated once), logits processing (penalties, min_tokens), logprobs and the token choice.

`adjust_logits` is the one place penalties and min_tokens act: the AR loop, prefill and the
speculative verify call it on the target's logits before sampling, so a drafted token is
accepted against exactly the distribution plain decoding would sample from. Logprobs are
the target's own log-softmax (before any adjustment or temperature) at the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import attrs
import torch

from pdflash.checks import require_int, require_number

SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch.Generator seed takes, as int64
MAX_TOP_LOGPROBS = 20


def _ids(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = all tokens
    max_tokens: int = 64  # new tokens at most
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)  # finish after any of these
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s))
    seed: int | None = None  # per-request generator seed
    presence_penalty: float = 0.0  # subtracted once from each token already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; divides positive / multiplies negative logits of prompt + output tokens
    min_p: float = 0.0  # drop tokens below min_p x the top probability, in [0, 1]
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are masked until this many are generated
    ignore_eos: bool = False  # the model's EOS tokens do not stop the sequence
    logprobs: int | None = None  # None: off; k: each emitted token's logprob and the k most likely alternatives

    def __attrs_post_init__(self) -> None:
        require_number("temperature", self.temperature, 0)
        require_number("top_p", self.top_p, 0, maximum=1, above=True)
        require_int("top_k", self.top_k, 0, why="0 disables it")
        require_int("max_tokens", self.max_tokens, 1)
        _check(
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids={list(self.stop_token_ids)!r} is invalid: it must be non-negative integers",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop={list(self.stop)!r} is invalid: it must be non-empty strings",
        )
        require_int("seed", self.seed, SEED_RANGE[0], maximum=SEED_RANGE[1], optional=True)
        for name in ("presence_penalty", "frequency_penalty"):
            require_number(name, getattr(self, name), -2, maximum=2)
        require_number("repetition_penalty", self.repetition_penalty, 0, above=True, why="1 disables it")
        require_number("min_p", self.min_p, 0, maximum=1)
        require_int("min_tokens", self.min_tokens, 0, maximum=self.max_tokens, why=f"max_tokens={self.max_tokens}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos={self.ignore_eos!r} is invalid: it must be a boolean")
        require_int("logprobs", self.logprobs, 0, maximum=MAX_TOP_LOGPROBS, optional=True)

    @property
    def penalized(self) -> bool:
        """Whether `adjust_logits` changes anything for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        return generator


@attrs.frozen
class TokenLogprob:
    token_id: int
    logprob: float  # the target's log-softmax at this token
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


def adjust_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    drafted: Sequence[int] = (),
    stop_ids: Collection[int] = (),
) -> torch.Tensor:
    """[R, V] logits → [R, V] with min_tokens and the penalties applied (vLLM's definitions).

    Row r continues prompt_ids + output_ids + drafted[:r] (a verify block's rows follow its
    drafted tokens), so each row is penalized by exactly the history it would have if the
    drafts before it are accepted. Returns `logits` itself when nothing applies.
    """
    if not params.penalized:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()
    if params.min_tokens and stop_ids:
        early = torch.arange(rows, device=device) + len(output_ids) < params.min_tokens  # [R]
        ids = torch.tensor(sorted(t for t in stop_ids if 0 <= t < vocab), dtype=torch.int64, device=device)
        if ids.numel():
            out[early.nonzero().flatten()[:, None], ids[None, :]] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        history = torch.tensor(list(output_ids), dtype=torch.int64, device=device)
        counts = torch.bincount(history, minlength=vocab).float().expand(rows, vocab).clone()  # [R, V]
        if rows > 1 and drafted:
            steps = torch.zeros(rows, vocab, device=device)
            tail = torch.tensor(list(drafted[: rows - 1]), dtype=torch.int64, device=device)
            steps[torch.arange(1, len(tail) + 1, device=device), tail] = 1.0
            counts += steps.cumsum(dim=0)
        if params.repetition_penalty != 1:
            seen = counts > 0
            if len(prompt_ids):
                seen[:, torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
            scaled = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, scaled, out)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """[≥n, V] raw logits, n emitted tokens (row i emitted token_ids[i]) → their log-softmax and top-k."""
    n = len(token_ids)
    if n == 0:
        return []
    logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V]
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    if top:
        values, indices = logp.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * n
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids, chosen, tops)]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] float32 logits → [R, V] the distribution the request samples from (temperature>0)."""
    scores = logits.float() / params.temperature  # [R, V]
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # [R, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p  # mass before this token already enough
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """[R, V] logits → [R] token ids: argmax when greedy, else a draw from `probabilities`."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)
