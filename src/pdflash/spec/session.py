"""One sequence's speculative state between rounds: the session, what its rounds return, its snapshot.

Owns the per-sequence state a round reads and writes (caches, anchor, pending draft,
context features, emitted tokens, round trace) and the snapshot that rewinds a session to
before a round, so a failed batched round can be retried one session at a time. The
algorithms that advance a session live in pdflash.spec.speculator.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from pdflash.sampling import SamplingParams, TokenLogprob
from pdflash.spec.projection import Projection, ProjectionQuality
from pdflash.stopping import StopRule
from pdflash.target.experts import ExpertKey
from pdflash.target.kv_cache import KVCache


class RoundOrderError(RuntimeError):
    """A round was asked for out of order (a bug in the caller)."""


@attrs.frozen(kw_only=True)
class DraftResult:
    block: tuple[int, ...]  # anchor + drafted tokens; its length is this round's verify tokens
    expert_union: frozenset[ExpertKey]  # projected (layer, expert) pairs the verify will route to
    expert_bytes: int  # exact Σ of the byte map over expert_union
    fetch_bytes: int  # the part of expert_bytes not resident at projection time
    projection_s: float  # this session's share of the batched projection
    # experts resident when the route was projected, less those a prefetch for the anchor brought
    # in since the verify before (its positions' bytes are measured against it: they are the round's)
    resident: frozenset[ExpertKey] = frozenset()
    # the projector's P(routed) per expert (pdflash.spec.projection.Projection.probability);
    # None: expert_union's members are taken as certain
    expert_probability: Mapping[ExpertKey, float] | None = attrs.field(default=None, eq=False, repr=False)
    # [b-1, V] the distribution q each draft was drawn from (rejection sampling tests against it);
    # None: point masses, i.e. argmax drafts (greedy) or a block set by hand
    draft_probs: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    # [d]: the drafter's confidence at each draft's position, the peak of its distribution there
    # (greedy: the block's drafts, then the shadow's; sampled: the block's, peaks of the q drawn
    # from); () for a plain round or penalized sampled drafts
    confidence: tuple[float, ...] = attrs.field(default=(), eq=False, repr=False)
    # drafts made past the block and not verified (a greedy session drafts the whole block whatever
    # it verifies): what they would have been accepted as is read off the tokens the target commits
    shadow: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.block)

    @property
    def drafted(self) -> bool:
        """The drafter ran for it (a block of drafts, or a plain round with shadow drafts)."""
        return len(self.block) + len(self.shadow) >= 2


@attrs.frozen(kw_only=True)
class RoundTrace:
    start: int  # absolute position of the anchor
    tokens: int  # verify block length
    acceptance_length: int  # tokens emitted this round, bonus included (τ of the round)
    expert_bytes: int  # projected union bytes
    fetch_bytes: int  # the part of expert_bytes not resident at projection time
    actual_bytes: int  # bytes of the union the verify routed
    quality: ProjectionQuality
    position_fetch_bytes: tuple[int, ...] = ()  # [tokens]: bytes each position's route added (measured)
    further_token_bytes: int = 0  # what one more token would have added beyond the batch's base


@attrs.frozen(kw_only=True)
class VerifyResult:
    accepted_ids: tuple[int, ...]  # tokens emitted this round (accepted drafts + bonus), after stop clipping
    accepted_drafts: int  # drafts accepted by the target (0 … block-1); acceptance length = this + 1
    committed: int  # tokens now in the target cache beyond the prompt
    finish_reason: str | None  # "stop" | "length" once the request has ended
    trace: RoundTrace  # this round's sizes, bytes and projection quality
    routed_union: frozenset[ExpertKey]  # (layer, expert) pairs the verify actually routed
    # the next round's anchor alone, projected as soon as this verify chose it (None: not asked
    # for, the request finished, or a projector that runs the target: Speculator.project_next_anchors)
    next_anchor: Projection | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define(eq=False)
class SpecSession:
    prompt_ids: list[int]
    params: SamplingParams
    rule: StopRule
    generator: torch.Generator | None
    target_cache: KVCache
    draft_cache: KVCache | None
    # tap features the drafter has not seen, in chunks ([c_i, n_taps*H] each, in order): a chunk a
    # round, joined only when the drafter reads them (`unseen_context`)
    context: tuple[torch.Tensor, ...]
    anchor: int  # last emitted token, not yet in the target cache
    start: int  # absolute position of the anchor
    emitted: list[int]
    logprobs: list[TokenLogprob]  # parallel to emitted when params.logprobs is set, else empty
    last_union: frozenset[ExpertKey]
    finish_reason: str | None = None
    pending: DraftResult | None = None
    trace: list[RoundTrace] = attrs.Factory(list)
    projection_s: float = 0.0
    verify_s: float = 0.0
    # experts the engine's prefetch for its anchor (VerifyResult.next_anchor) brings in, not
    # resident when it was asked: link bytes of its next round, spent before the round was drafted
    # (set and cleared by the engine around that round)
    anchor_fetch: frozenset[ExpertKey] = frozenset()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_lengths(self) -> list[int]:
        return [r.acceptance_length for r in self.trace]

    @property
    def kv_bytes(self) -> int:
        """Target + drafter KV cache bytes this session holds."""
        return self.target_cache.nbytes + (self.draft_cache.nbytes if self.draft_cache is not None else 0)

    def stats(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        return {
            "rounds": len(self.trace),
            "mean_acceptance_length": mean(self.acceptance_lengths),
            "projection_coverage": mean([r.quality.coverage for r in self.trace]),
            "projection_coverage_bytes": mean([r.quality.coverage_bytes for r in self.trace]),
            "projection_waste_bytes": sum(r.quality.waste_bytes for r in self.trace),
            "projected_expert_bytes": sum(r.expert_bytes for r in self.trace),
            "verify_expert_bytes": sum(r.actual_bytes for r in self.trace),
            "projection_s": self.projection_s,
            "verify_s": self.verify_s,
            "projection_to_verify_ratio": self.projection_s / self.verify_s if self.verify_s else 0.0,
        }

    @property
    def unseen_tokens(self) -> int:
        """Target tokens whose tap features the drafter has not seen."""
        return sum(chunk.shape[0] for chunk in self.context)

    def unseen_context(self) -> torch.Tensor:
        """[c, n_taps*H] the features the drafter has not seen, as one tensor (at least one chunk).

        Kept in chunks until read: joined every round instead, a sequence that decodes plainly
        copied its whole growing context each round, quadratic in its length (the bundled pair:
        a 160-token prompt's 0.65 MB and up, 15-40 µs per sequence and round on the target lane)."""
        return self.context[0] if len(self.context) == 1 else torch.cat(self.context)

    def snapshot(self) -> SessionSnapshot:
        """What a draft or verify round may change, captured before it (see `restore`)."""
        return SessionSnapshot(
            fields={name: getattr(self, name) for name in _ROUND_FIELDS},
            emitted=len(self.emitted),
            rounds=len(self.trace),
            target_length=self.target_cache.length,
            draft_length=None if self.draft_cache is None else self.draft_cache.length,
            generator_state=None if self.generator is None else self.generator.get_state(),
            watcher_mark=None if self.rule.watcher is None else self.rule.watcher.mark(),
        )

    def restore(self, snapshot: SessionSnapshot) -> None:
        """Rewind to `snapshot`: a batch that raised left its sessions partly advanced (caches
        written, some accepted); restoring each lets it be retried alone to find the culprit."""
        for name, value in snapshot.fields.items():
            setattr(self, name, value)
        del self.emitted[snapshot.emitted :]
        del self.logprobs[snapshot.emitted :]
        del self.trace[snapshot.rounds :]
        self.target_cache.crop(snapshot.target_length)
        if self.draft_cache is not None and snapshot.draft_length is not None:
            self.draft_cache.crop(snapshot.draft_length)
        if self.generator is not None and snapshot.generator_state is not None:
            self.generator.set_state(snapshot.generator_state)
        if self.rule.watcher is not None:
            self.rule.watcher.rewind(snapshot.watcher_mark)


_ROUND_FIELDS = ("anchor", "start", "context", "pending", "last_union", "finish_reason", "projection_s", "verify_s")


@attrs.frozen(kw_only=True)
class SessionSnapshot:
    """A session as it was before a round (SpecSession.snapshot / restore)."""

    fields: dict  # session attribute -> value before the round
    emitted: int  # len(session.emitted)
    rounds: int  # len(session.trace)
    target_length: int  # tokens in the target KV cache
    draft_length: int | None  # tokens in the drafter KV cache (None without a drafter)
    generator_state: torch.Tensor | None  # sampling RNG state (None when greedy)
    watcher_mark: object  # the stop watcher's state (None without one)
