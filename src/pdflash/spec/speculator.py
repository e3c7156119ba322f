"""The SpecSession seam: per-sequence speculative rounds (prefill, draft, verify) the engine interleaves.

Owns one round's algorithm (DFLASH.md): draft a block, project its routed experts, verify
it with the target, accept the longest matching prefix plus a bonus token, roll the target
cache back. Without a drafter the same rounds decode autoregressively (a block of just the
anchor). It never schedules: callers decide which sessions run a round together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

import attrs
import torch

from pdflash.sampling import SamplingParams, TokenLogprob, adjust_logits, sample, token_logprobs
from pdflash.spec.drafter import DFlashDrafter
from pdflash.spec.projection import ExpertKey, ProjectionQuality, make_projector, routed_union, union_bytes
from pdflash.stopping import StopRule
from pdflash.target.kv_cache import KVCache
from pdflash.target.model import Qwen3MoeModel


class RoundOrderError(RuntimeError):
    """A round was asked for out of order (a bug in the caller)."""


@attrs.frozen(kw_only=True)
class DraftResult:
    block: tuple[int, ...]  # anchor + drafted tokens; its length is this round's verify tokens
    expert_union: frozenset[ExpertKey]  # projected (layer, expert) pairs the verify will route to
    expert_bytes: int  # exact Σ of the byte map over expert_union
    fetch_bytes: int  # the part of expert_bytes not resident at projection time
    projection_seconds: float  # this session's share of the batched projection

    @property
    def tokens(self) -> int:
        return len(self.block)


@attrs.frozen(kw_only=True)
class VerifyResult:
    accepted_ids: tuple[int, ...]  # tokens emitted this round (accepted drafts + bonus), after stop clipping
    accept_len: int  # drafts accepted by the target (0 … block-1)
    committed: int  # tokens now in the target cache beyond the prompt
    finished: bool
    finish_reason: str | None


@attrs.frozen(kw_only=True)
class RoundTrace:
    start: int  # absolute position of the anchor
    tokens: int  # verify block length
    acceptance_length: int  # tokens emitted this round, bonus included (τ of the round)
    expert_bytes: int  # projected union bytes
    fetch_bytes: int
    actual_bytes: int  # bytes of the union the verify routed
    quality: ProjectionQuality


@attrs.define(eq=False)
class SpecSession:
    prompt_ids: list[int]
    params: SamplingParams
    rule: StopRule
    generator: torch.Generator | None
    target_cache: KVCache
    draft_cache: KVCache | None
    context: torch.Tensor | None  # [c, n_taps*H] tap features the drafter has not seen
    anchor: int  # last emitted token, not yet in the target cache
    start: int  # absolute position of the anchor
    emitted: list[int]
    logprobs: list[TokenLogprob]  # parallel to emitted when params.logprobs is set, else empty
    last_union: frozenset[ExpertKey]
    finish_reason: str | None = None
    pending: DraftResult | None = None
    trace: list[RoundTrace] = attrs.Factory(list)
    projection_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_lengths(self) -> list[int]:
        return [r.acceptance_length for r in self.trace]

    def stats(self) -> dict:
        rounds = len(self.trace)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        return {
            "rounds": rounds,
            "mean_acceptance_length": mean(self.acceptance_lengths),
            "projection_coverage": mean([r.quality.coverage for r in self.trace]),
            "projection_coverage_bytes": mean([r.quality.coverage_bytes for r in self.trace]),
            "projection_waste_bytes": sum(r.quality.waste_bytes for r in self.trace),
            "projected_expert_bytes": sum(r.expert_bytes for r in self.trace),
            "verify_expert_bytes": sum(r.actual_bytes for r in self.trace),
            "projection_seconds": self.projection_seconds,
            "verify_seconds": self.verify_seconds,
            "projection_to_verify_ratio": self.projection_seconds / self.verify_seconds if self.verify_seconds else 0.0,
        }


class Speculator:
    """Runs rounds for many sessions at once over one target (and optionally one DFlash drafter)."""

    def __init__(
        self,
        target: Qwen3MoeModel,
        drafter: DFlashDrafter | None = None,
        *,
        expert_nbytes: dict[ExpertKey, int],
        projector: str = "router",
        block_size: int | None = None,
        resident: Callable[[], Collection[ExpertKey]] = frozenset,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.expert_nbytes = expert_nbytes
        self.projector = make_projector(projector)
        self.resident = resident
        if drafter is None:
            self.block_size = 1
        else:
            self.block_size = block_size or drafter.config.block_size
            if self.block_size < 2:
                raise ValueError(f"block_size must be >= 2 with a drafter, got {self.block_size}")
        self.taps = drafter.config.tap_layers if drafter else ()

    # -- prefill -------------------------------------------------------------------------
    def begin_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> SpecSession:
        return self.begin_sessions([(prompt_ids, params)])[0]

    def begin_sessions(self, requests: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[SpecSession]:
        """Prefill many prompts in one target forward; each gets its first token."""
        cfg = self.target.config
        rules = [StopRule.for_request(len(p), sp, cfg.max_positions, cfg.eos_token_ids) for p, sp in requests]
        for prompt, _ in requests:
            bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{cfg.vocab_size - 1}")
        caches = [self.target.new_cache() for _ in requests]
        prompts = [torch.tensor(list(p), dtype=torch.int64) for p, _ in requests]
        out = self.target.forward(prompts, caches, last_logits_only=True, taps=self.taps)
        taps = out.split(out.taps) if self.taps else [None] * len(requests)
        sessions = []
        for i, ((prompt, params), rule) in enumerate(zip(requests, rules)):
            generator = params.generator(self.target.device)
            logits = out.logits[i : i + 1]  # [1, V]
            adjusted = adjust_logits(logits, params, prompt_ids=prompt, output_ids=(), stop_ids=rule.stop_ids)
            first = int(sample(adjusted, params, generator)[0])
            kept, finish = rule.clip(0, [first])
            recent = out.split(out.routed)[i][-self.block_size :]
            sessions.append(
                SpecSession(
                    prompt_ids=list(prompt),
                    params=params,
                    rule=rule,
                    generator=generator,
                    target_cache=caches[i],
                    draft_cache=self.drafter.new_cache() if self.drafter else None,
                    context=taps[i],
                    anchor=first,
                    start=len(prompt),
                    emitted=kept,
                    logprobs=token_logprobs(logits, kept, params.logprobs) if params.logprobs is not None else [],
                    finish_reason=finish,
                    last_union=routed_union(recent, cfg.moe_layer_ids),
                )
            )
        return sessions

    # -- draft ---------------------------------------------------------------------------
    def draft_round(self, session: SpecSession) -> DraftResult:
        return self.draft_rounds([session])[0]

    def draft_rounds(self, sessions: Sequence[SpecSession]) -> list[DraftResult]:
        for s in sessions:
            if s.finished:
                raise RoundOrderError("draft_round on a finished session")
            if s.pending is not None:
                raise RoundOrderError("draft_round twice without a verify_round in between")
        sizes = [min(self.block_size, s.rule.max_new_tokens - len(s.emitted) + 1) for s in sessions]
        blocks = self._drafted_blocks(sessions, sizes)
        started = time.perf_counter()
        unions = self.projector.project(self, sessions, blocks)
        share = (time.perf_counter() - started) / len(sessions)
        resident = self.resident()
        results = []
        for s, block, union in zip(sessions, blocks, unions):
            s.pending = DraftResult(
                block=tuple(block.tolist()),
                expert_union=union,
                expert_bytes=union_bytes(union, self.expert_nbytes),
                fetch_bytes=union_bytes(union - set(resident), self.expert_nbytes),
                projection_seconds=share,
            )
            s.projection_seconds += share
            results.append(s.pending)
        return results

    def _drafted_blocks(self, sessions: Sequence[SpecSession], sizes: list[int]) -> list[torch.Tensor]:
        anchors = [torch.tensor([s.anchor], dtype=torch.int64) for s in sessions]
        if self.drafter is None:
            return anchors
        mask = self.drafter.config.mask_token_id
        noisy = [torch.cat([a, torch.full((n - 1,), mask, dtype=torch.int64)]) for a, n in zip(anchors, sizes)]
        logits = self.drafter.draft_logits([s.context for s in sessions], noisy, [s.draft_cache for s in sessions])
        for s in sessions:
            s.context = None
        return [torch.cat([a, lg.argmax(dim=-1).cpu()]) for a, lg in zip(anchors, logits)]

    # -- verify --------------------------------------------------------------------------
    def verify_round(self, session: SpecSession) -> VerifyResult:
        return self.verify_rounds([session])[0]

    def verify_rounds(self, sessions: Sequence[SpecSession]) -> list[VerifyResult]:
        for s in sessions:
            if s.finished:
                raise RoundOrderError("verify_round on a finished session")
            if s.pending is None:
                raise RoundOrderError("verify_round without a pending draft_round")
        blocks = [torch.tensor(s.pending.block, dtype=torch.int64) for s in sessions]
        started = time.perf_counter()
        out = self.target.forward(blocks, [s.target_cache for s in sessions], taps=self.taps)
        share = (time.perf_counter() - started) / len(sessions)
        taps = out.split(out.taps) if self.taps else [None] * len(sessions)
        return [
            self._accept(s, block, logits, routed, tap, share)
            for s, block, logits, routed, tap in zip(
                sessions, blocks, out.split(out.logits), out.split(out.routed), taps
            )
        ]

    def _accept(self, s: SpecSession, block, logits, routed, taps, verify_seconds: float) -> VerifyResult:
        adjusted = adjust_logits(  # row j continues the drafts before it
            logits,
            s.params,
            prompt_ids=s.prompt_ids,
            output_ids=s.emitted,
            drafted=block[1:].tolist(),
            stop_ids=s.rule.stop_ids,
        )
        posterior = sample(adjusted, s.params, s.generator).cpu()  # [b] target's token after each block position
        matches = (block[1:] == posterior[:-1]).int().cumprod(dim=0)  # [b-1]
        accepted = int(matches.sum())
        kept, finish = s.rule.clip(len(s.emitted), block[1 : accepted + 1].tolist() + [int(posterior[accepted])])
        if s.params.logprobs is not None:  # emitted token k was sampled from row k
            s.logprobs += token_logprobs(logits, kept, s.params.logprobs)
        s.emitted += kept
        s.target_cache.crop(s.start + accepted + 1)
        s.context = taps[: accepted + 1] if taps is not None else None
        actual = routed_union(routed, self.target.config.moe_layer_ids)
        pending = s.pending
        s.trace.append(
            RoundTrace(
                start=s.start,
                tokens=len(block),
                acceptance_length=len(kept),
                expert_bytes=pending.expert_bytes,
                fetch_bytes=pending.fetch_bytes,
                actual_bytes=union_bytes(actual, self.expert_nbytes),
                quality=ProjectionQuality.compare(pending.expert_union, actual, self.expert_nbytes),
            )
        )
        s.anchor, s.start = int(posterior[accepted]), s.start + accepted + 1
        s.last_union, s.pending, s.finish_reason = actual, None, finish
        s.verify_seconds += verify_seconds
        return VerifyResult(
            accepted_ids=tuple(kept),
            accept_len=accepted,
            committed=s.start - len(s.prompt_ids),
            finished=finish is not None,
            finish_reason=finish,
        )

    def release(self, session: SpecSession) -> None:
        """Free the session's caches (finished, aborted or failed)."""
        session.target_cache.release()
        if session.draft_cache is not None:
            session.draft_cache.release()
        session.context = None
        session.pending = None


def speculative_generate(speculator: Speculator, prompt_ids: Sequence[int], params: SamplingParams):
    """Whole-request loop over the seam (a convenience; the engine interleaves rounds instead)."""
    from pdflash.target.generate import GenerationResult

    started = time.perf_counter()
    session = speculator.begin_session(prompt_ids, params)
    first_at = time.perf_counter()
    while not session.finished:
        speculator.draft_round(session)
        speculator.verify_round(session)
    done = time.perf_counter()
    speculator.release(session)
    n = len(session.emitted)
    return GenerationResult(
        token_ids=tuple(session.emitted),
        finish_reason=session.finish_reason,
        acceptance_lengths=tuple(session.acceptance_lengths),
        stats={
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": n,
            "seconds": done - started,
            "time_to_first_token_seconds": first_at - started,
            "tokens_per_second": (n - 1) / (done - first_at) if n > 1 and done > first_at else 0.0,
        }
        | session.stats(),
    )
