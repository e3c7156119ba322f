"""The SpecSession seam: per-sequence speculative rounds (prefill, draft, verify) the engine interleaves.

Owns one round's algorithm (DFLASH.md): draft a block, project its routed experts, verify
it with the target, accept the longest matching prefix plus a bonus token, roll the target
cache back. Without a drafter the same rounds decode autoregressively (a block of just the
anchor). It never schedules: callers decide which sessions run a round together.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence, Set

import attrs
import torch

from pdflash.measure import tokens_per_second
from pdflash.sampling import SamplingParams, adjust_logits, probabilities, sample, token_logprobs
from pdflash.spec import rejection
from pdflash.spec.drafter import DFlashDrafter
from pdflash.spec.policy import VerifyCut
from pdflash.spec.projection import (
    Projection,
    ProjectionQuality,
    Projector,
    make_projector,
    routed_union,
    union_bytes,
)
from pdflash.spec.session import DraftResult, RoundOrderError, RoundTrace, SpecSession, VerifyResult
from pdflash.stopping import StopRule, StopWatcher
from pdflash.target.experts import ExpertKey
from pdflash.target.kv_cache import KVCache
from pdflash.target.loader import TargetModel


class Speculator:
    """Runs rounds for many sessions at once over one target (and optionally one DFlash drafter)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        *,
        expert_nbytes: dict[ExpertKey, int],
        projector: str | Projector = "router",  # a name (make_projector) or a built projector
        block_size: int | None = None,
        resident: Callable[[], Collection[ExpertKey]] = frozenset,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.expert_nbytes = expert_nbytes
        self.projector = make_projector(projector) if isinstance(projector, str) else projector
        self.resident = resident
        if drafter is None:
            self.block_size = 1
        else:
            self.block_size = block_size or drafter.config.block_size
            if self.block_size < 2:
                raise ValueError(f"block_size must be >= 2 with a drafter, got {self.block_size}")
        self.taps = drafter.config.tap_layers if drafter else ()
        # each verify also projects the next round's anchor alone (VerifyResult.next_anchor), so its
        # experts can be fetched while the drafter drafts; only a projector that never runs the target
        self.project_next_anchors = False

    # -- prefill -------------------------------------------------------------------------
    def begin_session(
        self, prompt_ids: Sequence[int], params: SamplingParams, watcher: StopWatcher | None = None
    ) -> SpecSession:
        return self.begin_sessions([(prompt_ids, params)], [watcher])[0]

    def begin_sessions(
        self,
        requests: Sequence[tuple[Sequence[int], SamplingParams]],
        watchers: Sequence[StopWatcher | None] | None = None,
    ) -> list[SpecSession]:
        """Prefill many prompts in one target forward; each gets its first token.

        `watchers[i]` (e.g. the request's text stream) sees every token request i emits, for
        its stop strings; the session's StopRule decides with it when the request ends.
        """
        return self.verify_and_begin([], requests, watchers)[1]

    def _begun(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        rule: StopRule,
        cache: KVCache,
        logits: torch.Tensor,  # [1, V] its last prompt token's
        routed: torch.Tensor,  # [n, L_moe, K] its prompt's routes
        taps: torch.Tensor | None,  # [n, n_taps*H]
    ) -> SpecSession:
        """A prefilled prompt's session, with its first token."""
        generator = params.generator(self.target.device)
        adjusted = adjust_logits(logits, params, prompt_ids=prompt, output_ids=(), stop_ids=rule.stop_ids)
        first = int(sample(adjusted, params, generator)[0])
        kept, finish = rule.clip(0, [first])
        return SpecSession(
            prompt_ids=list(prompt),
            params=params,
            rule=rule,
            generator=generator,
            target_cache=cache,
            draft_cache=self.drafter.new_cache() if self.drafter else None,
            context=(taps,) if taps is not None else (),
            anchor=first,
            start=len(prompt),
            emitted=kept,
            logprobs=token_logprobs(logits, kept, params.logprobs) if params.logprobs is not None else [],
            finish_reason=finish,
            last_union=routed_union(routed[-self.block_size :], self.target.config.moe_layer_ids),
        )

    # -- draft ---------------------------------------------------------------------------
    def draft_round(self, session: SpecSession) -> DraftResult:
        return self.draft_rounds([session])[0]

    def draft_rounds(
        self,
        sessions: Sequence[SpecSession],
        sizes: Sequence[int] | None = None,
        drafted: Sequence[int] | None = None,
        cuts: Sequence[VerifyCut | None] | None = None,
    ) -> list[DraftResult]:
        """Draft each session's next block: `sizes[i]` tokens, anchor included (default: the block size).

        A size of 1 is plain decoding: the block is the anchor alone and the drafter does not run
        for that session (its unseen context waits for the next round that drafts). `drafted[i]`
        (default `sizes[i]`; at least it, at most the block size) is how many the drafter makes:
        those past `sizes[i]` are not verified, only kept as the result's `shadow` drafts, and
        only a greedy session may draft more than it verifies (its drafts are argmaxes, so the
        extra ones change no random number the block's own drafts were drawn with). A session
        given `cuts[i]` verifies as many of its drafts as the cut chooses from the drafter's
        confidence in each, once they are made (pdflash.spec.policy.VerifyCut); a sampled one's
        drafts cut are dropped. Both keep the output exact: any split of greedy tokens into
        verifies commits the same tokens, and a sampled session's confidence is read off the q
        its drafts were drawn from, not off the drafts (`_drafted_blocks`), so where its verify
        stops does not depend on what was drawn.
        """
        for s in sessions:
            _check_draftable(s)
        wanted = sizes if sizes is not None else [self.block_size] * len(sessions)
        for size in wanted:
            if not 1 <= size <= self.block_size:
                raise ValueError(f"a drafted block holds 1..{self.block_size} tokens, got {size}")
        made = drafted if drafted is not None else wanted
        for s, size, n in zip(sessions, wanted, made, strict=True):
            if not size <= n <= self.block_size or (n > size and not s.params.greedy):
                raise ValueError(
                    f"a session drafts {size}..{self.block_size} tokens for a block of {size} "
                    f"(more only when greedy), got {n}"
                )
        room = [s.rule.max_new_tokens - len(s.emitted) + 1 for s in sessions]  # tokens it may still emit, + 1
        full, draft_probs, confidence = self._drafted_blocks(
            sessions, [min(n, r) for n, r in zip(made, room, strict=True)]
        )
        cut_to = [
            cut.block(sure) if cut is not None and sure else size
            for cut, sure, size in zip(cuts or [None] * len(sessions), confidence, wanted, strict=True)
        ]
        sizes = [min(n, r) for n, r in zip(cut_to, room, strict=True)]
        blocks = [block[:n] for block, n in zip(full, sizes, strict=True)]
        started = time.perf_counter()
        projections = self.projector.project(self, sessions, blocks)
        share = (time.perf_counter() - started) / len(sessions)
        resident = frozenset(self.resident())
        for s in sessions:
            s.projection_s += share
        return [
            self._pend(
                s,
                tuple(block.tolist()),
                tuple(whole[len(block) :].tolist()) if s.params.greedy else (),
                q[: len(block) - 1] if q is not None else None,
                sure if s.params.greedy else sure[: len(block) - 1],
                projection,
                resident,
                share,
            )
            for s, block, whole, q, sure, projection in zip(
                sessions, blocks, full, draft_probs, confidence, projections, strict=True
            )
        ]

    def plain_round(self, session: SpecSession, anchor: Projection) -> DraftResult:
        """The round of `session`'s anchor alone (plain decoding), its projection given: what
        `draft_rounds([session], [1])` makes, without a projector call. The verify before it
        projected that anchor already (VerifyResult.next_anchor, counted in its projection_s),
        and a target-free projector's projection of a block of one is exactly that."""
        _check_draftable(session)
        return self._pend(session, (session.anchor,), (), None, (), anchor, frozenset(self.resident()), 0.0)

    def _pend(
        self,
        s: SpecSession,
        block: tuple[int, ...],
        shadow: tuple[int, ...],
        q: torch.Tensor | None,
        confidence: tuple[float, ...],
        projection: Projection,
        resident: frozenset[ExpertKey],
        projection_s: float,
    ) -> DraftResult:
        """`s`'s pending round: `block` to verify, its projected experts priced against `resident`."""
        union = projection.union
        s.pending = DraftResult(
            block=block,
            shadow=shadow,
            draft_probs=q,
            confidence=confidence,
            expert_union=union,
            expert_probability=projection.probability,
            expert_bytes=union_bytes(union, self.expert_nbytes),
            fetch_bytes=union_bytes(union - resident, self.expert_nbytes),
            projection_s=projection_s,
            resident=resident - s.anchor_fetch,
        )
        return s.pending

    def _drafted_blocks(
        self, sessions: Sequence[SpecSession], sizes: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[tuple[float, ...]]]:
        """Each session's [b] anchor + drafts, the [b-1, V] q its drafts were drawn from (None: argmax),
        and the drafter's confidence at each draft's position: the peak of its distribution there
        (greedy: the softmax's, whose peak is the argmax drafted; sampled: the q drawn from, once
        temperature, top-k and top-p shaped it). A sampled session with penalties gets none: each
        of its q depends on the drafts drawn before it, so a cut by it would depend on the draws."""
        blocks = [torch.tensor([s.anchor], dtype=torch.int64) for s in sessions]
        probs: list[torch.Tensor | None] = [None] * len(sessions)
        confidence: list[tuple[float, ...]] = [()] * len(sessions)
        drafting = [i for i, n in enumerate(sizes) if n >= 2]
        if self.drafter is None or not drafting:
            return blocks, probs, confidence
        mask = self.drafter.config.mask_token_id
        noisy, contexts, caches = [], [], []
        for i in drafting:
            s = sessions[i]
            if not s.context or s.draft_cache is None:
                raise RoundOrderError("draft_round on a session with no new target context (rounds out of order)")
            noisy.append(torch.cat([blocks[i], torch.full((sizes[i] - 1,), mask, dtype=torch.int64)]))
            contexts.append(s.unseen_context())
            caches.append(s.draft_cache)
        logits = self.drafter.draft_logits(contexts, noisy, caches)
        for i, lg in zip(drafting, logits, strict=True):
            s = sessions[i]
            s.context = ()
            drafts, q = rejection.propose(
                lg, s.params, s.generator, prompt_ids=s.prompt_ids, output_ids=s.emitted, stop_ids=s.rule.stop_ids
            )
            blocks[i], probs[i] = torch.cat([blocks[i], drafts.cpu()]), q
            if q is None:  # argmax drafts: how sure the drafter was of each
                sure = torch.softmax(lg.float(), dim=-1).gather(-1, drafts.view(-1, 1).to(lg.device))  # [b-1, 1]
                confidence[i] = tuple(sure.view(-1).tolist())
            elif not s.params.penalized:  # drawn: the peak of each q, whatever was drawn from it
                confidence[i] = tuple(q.max(dim=-1).values.tolist())  # [b-1]
        return blocks, probs, confidence

    # -- verify --------------------------------------------------------------------------
    def verify_round(self, session: SpecSession) -> VerifyResult:
        return self.verify_rounds([session])[0]

    def verify_rounds(self, sessions: Sequence[SpecSession]) -> list[VerifyResult]:
        return self.verify_and_begin(sessions, [])[0]

    def verify_and_begin(
        self,
        sessions: Sequence[SpecSession],
        requests: Sequence[tuple[Sequence[int], SamplingParams]],
        watchers: Sequence[StopWatcher | None] | None = None,
    ) -> tuple[list[VerifyResult], list[SpecSession]]:
        """Verify `sessions`' drafted blocks and prefill `requests`' prompts in ONE target forward:
        what `verify_rounds(sessions)` and `begin_sessions(requests, watchers)` return, while the
        experts both route to are read once (behind a link, a prompt's prefill routes through
        nearly every expert). Every input is checked before the forward runs."""
        cfg = self.target.config
        watchers = watchers if watchers is not None else [None] * len(requests)
        rules = [
            StopRule.for_request(len(p), sp, cfg.max_positions, cfg.eos_token_ids, watcher)
            for (p, sp), watcher in zip(requests, watchers, strict=True)
        ]
        for prompt, _ in requests:
            bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{cfg.vocab_size - 1}")
        drafts = [_pending_draft(s) for s in sessions]
        if not drafts and not requests:
            return [], []
        blocks = [torch.tensor(d.block, dtype=torch.int64) for d in drafts]
        prompts = [torch.tensor(list(p), dtype=torch.int64) for p, _ in requests]
        caches = [self.target.new_cache() for _ in requests]
        # a verify needs every position's logits, a prefill its last token's
        last: bool | list[bool] = [False] * len(blocks) + [True] * len(prompts) if blocks and prompts else not blocks
        started = time.perf_counter()
        out = self.target.forward(
            blocks + prompts, [s.target_cache for s in sessions] + caches, last_logits_only=last, taps=self.taps
        )
        share = (time.perf_counter() - started) / len(out.seq_lens)
        n = len(sessions)
        logits, routed, taps = out.split_logits(), out.split(out.routed), out.split_taps()
        begun = [
            self._begun(prompt, params, rule, cache, lg, r, tap)
            for (prompt, params), rule, cache, lg, r, tap in zip(
                requests, rules, caches, logits[n:], routed[n:], taps[n:], strict=True
            )
        ]
        if not sessions:
            return [], begun
        routes = [self._token_routes(r) for r in routed[:n]]
        residents = [d.resident for d in drafts]
        position_bytes = position_fetch_bytes(residents, routes, self.expert_nbytes)
        further = further_token_bytes(residents, routes, self.expert_nbytes)
        choices = self._next_tokens(sessions, blocks, drafts, logits[:n])
        verified = [
            self._accept(s, block, choice, lg, r, tap, share, positions, more)
            for s, block, choice, lg, r, tap, positions, more in zip(
                sessions, blocks, choices, logits, routed, taps, position_bytes, further
            )
        ]
        if self.project_next_anchors:
            verified = self._with_next_anchors(sessions, verified)
        return verified, begun

    def _with_next_anchors(self, sessions: Sequence[SpecSession], verified: list[VerifyResult]) -> list[VerifyResult]:
        """`verified`, each unfinished one with its session's next anchor projected alone (one
        projector call for all: a route head's is one small matmul)."""
        if not self.projector.target_free:
            raise ValueError(
                f"projector {self.projector.name!r} runs the target: it cannot project anchors beside verifies"
            )
        going = [i for i, v in enumerate(verified) if not v.finished]
        if not going:
            return verified
        anchors = [torch.tensor([sessions[i].anchor], dtype=torch.int64) for i in going]
        started = time.perf_counter()
        projections = dict(zip(going, self.projector.project(self, [sessions[i] for i in going], anchors), strict=True))
        share = (time.perf_counter() - started) / len(going)
        for i in going:
            sessions[i].projection_s += share
        return [attrs.evolve(v, next_anchor=projections.get(i)) for i, v in enumerate(verified)]

    def _token_routes(self, routed: torch.Tensor) -> list[frozenset[ExpertKey]]:
        """[n, L_moe, K] routed ids -> each token's (layer, expert) pairs."""
        layers = self.target.config.moe_layer_ids
        return [frozenset((l, e) for l, experts in zip(layers, token) for e in experts) for token in routed.tolist()]

    def _next_tokens(
        self,
        sessions: Sequence[SpecSession],
        blocks: Sequence[torch.Tensor],
        drafts: Sequence[DraftResult],
        logits: Sequence[torch.Tensor],
    ) -> list[tuple[int, int]]:
        """Per session (drafts accepted, the target's token after them) from its [b, V] verify logits.

        Greedy sessions and blocks without drafts take the target's own token at each position
        (argmax, or a plain sample) and accept the drafts equal to it; sampled blocks with
        drafts go through `rejection.accept` together, against the q they were drawn from.
        """
        choices: dict[int, tuple[int, int]] = {}
        sampled: list[tuple[int, torch.Tensor]] = []  # (index, p [b, V])
        for i, (s, block, lg) in enumerate(zip(sessions, blocks, logits)):
            adjusted = adjust_logits(  # row j continues the drafts before it
                lg,
                s.params,
                prompt_ids=s.prompt_ids,
                output_ids=s.emitted,
                drafted=block[1:].tolist(),
                stop_ids=s.rule.stop_ids,
            )
            if len(block) == 1:  # plain decoding: nothing to accept
                choices[i] = (0, int(sample(adjusted, s.params, s.generator)[0]))
            elif s.params.greedy:
                posterior = sample(adjusted, s.params, s.generator).cpu()  # [b] target's token after each position
                accepted = int((block[1:] == posterior[:-1]).int().cumprod(dim=0).sum())
                choices[i] = (accepted, int(posterior[accepted]))
            else:
                sampled.append((i, probabilities(adjusted, s.params)))
        if sampled:
            decided = rejection.accept_blocks(
                [p for _, p in sampled],
                [drafts[i].draft_probs for i, _ in sampled],
                [blocks[i][1:] for i, _ in sampled],
                [sessions[i].generator for i, _ in sampled],
            )
            for (i, _), a, t in zip(sampled, *decided):
                choices[i] = (a, t)
        return [choices[i] for i in range(len(sessions))]

    def _accept(
        self,
        s: SpecSession,
        block,
        choice: tuple[int, int],
        logits,
        routed,
        taps,
        verify_s: float,
        position_fetch_bytes: tuple[int, ...],
        further_token_bytes: int,
    ) -> VerifyResult:
        accepted, next_token = choice
        kept, finish = s.rule.clip(len(s.emitted), block[1 : accepted + 1].tolist() + [next_token])
        if s.params.logprobs is not None:  # emitted token k was sampled from row k (the raw logits)
            s.logprobs += token_logprobs(logits, kept, s.params.logprobs)
        s.emitted += kept
        s.target_cache.crop(s.start + accepted + 1)
        if taps is not None:  # a session that skipped the drafter still holds unseen context
            s.context = (*s.context, taps[: accepted + 1].clone())  # a copy: a view would hold the batch's taps
        actual = routed_union(routed, self.target.config.moe_layer_ids)
        pending = _pending_draft(s)
        trace = RoundTrace(
            start=s.start,
            tokens=len(block),
            acceptance_length=len(kept),
            expert_bytes=pending.expert_bytes,
            fetch_bytes=pending.fetch_bytes,
            actual_bytes=union_bytes(actual, self.expert_nbytes),
            quality=ProjectionQuality.compare(pending.expert_union, actual, self.expert_nbytes),
            position_fetch_bytes=position_fetch_bytes,
            further_token_bytes=further_token_bytes,
        )
        s.trace.append(trace)
        s.anchor, s.start = next_token, s.start + accepted + 1
        s.last_union, s.pending, s.finish_reason = actual, None, finish
        s.verify_s += verify_s
        return VerifyResult(
            accepted_ids=tuple(kept),
            accepted_drafts=accepted,
            committed=s.start - len(s.prompt_ids),
            finish_reason=finish,
            trace=trace,
            routed_union=actual,
        )

    def union_bytes(self, union: frozenset[ExpertKey]) -> int:
        """Exact bytes of `union` over the byte map."""
        return union_bytes(union, self.expert_nbytes)

    def release(self, session: SpecSession) -> None:
        """Free the session's caches (finished, aborted or failed)."""
        session.target_cache.release()
        if session.draft_cache is not None:
            session.draft_cache.release()
        session.context = ()
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
    assert session.finish_reason is not None  # the loop ran until the session finished
    n = len(session.emitted)
    return GenerationResult(
        token_ids=tuple(session.emitted),
        finish_reason=session.finish_reason,
        acceptance_lengths=tuple(session.acceptance_lengths),
        stats={
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": n,
            "elapsed_s": done - started,
            "ttft_s": first_at - started,
            "tokens_per_second": tokens_per_second(n, first_at, done),
        }
        | session.stats(),
    )


def _check_draftable(session: SpecSession) -> None:
    if session.finished:
        raise RoundOrderError("draft_round on a finished session")
    if session.pending is not None:
        raise RoundOrderError("draft_round twice without a verify_round in between")


def _pending_draft(session: SpecSession) -> DraftResult:
    """The session's drafted block, checking the round order (a verify needs one pending draft)."""
    if session.finished:
        raise RoundOrderError("verify_round on a finished session")
    if session.pending is None:
        raise RoundOrderError("verify_round without a pending draft_round")
    return session.pending


def position_fetch_bytes(
    residents: Sequence[Set[ExpertKey]],
    routes: Sequence[Sequence[frozenset[ExpertKey]]],
    expert_nbytes: Mapping[ExpertKey, int],
) -> list[tuple[int, ...]]:
    """Per session of one batched verify, per block position k: the link bytes token k's route
    brought, measured (the speculation policy's byte estimate; `pdflash simulate` charges the same).

    `residents[i]`: what was resident when session i's block was drafted; `routes[i][k]`: its
    token k's routed (layer, expert) pairs. Only experts not resident when the block was drafted
    count. The batch's union is grown position by position, as if every session verified one
    token more each step: the first positions form its base (the union a round of plain decoding
    would fetch anyway); then position k of every session that has one adds what no earlier
    position of any session brought. Each expert a step adds is shared among the sessions whose
    position k routed it. So a position is priced by what the batch fetches because the blocks
    reach it, which is what the policy weighs when it asks how far to go: in a large batch a
    late position mostly routes experts that earlier positions already brought. The charges of
    one batch add up to what the batch fetched."""
    fresh = [[route - resident for route in own] for resident, own in zip(residents, routes, strict=True)]
    out: list[list[int]] = [[] for _ in fresh]
    covered: set[ExpertKey] = set()
    for k in range(max(map(len, fresh), default=0)):
        users = Counter(e for own in fresh if len(own) > k for e in own[k] if e not in covered)
        for own, positions in zip(fresh, out, strict=True):
            if len(own) > k:
                positions.append(round(sum(expert_nbytes[e] / users[e] for e in own[k] if e in users)))
        covered |= users.keys()
    return [tuple(positions) for positions in out]


def further_token_bytes(
    residents: Sequence[Set[ExpertKey]],
    routes: Sequence[Sequence[frozenset[ExpertKey]]],
    expert_nbytes: Mapping[ExpertKey, int],
) -> list[int]:
    """Per session: what one more token would have added beyond the rest of the batch's base, had
    it routed like the session's first token (its experts no other session's first token routed,
    not resident). The policy's price for block positions no verify has measured yet: at c = 1 a
    whole token's misses, in a large batch almost nothing."""
    firsts = _firsts(residents, routes)
    base_users = Counter(e for first in firsts for e in first)
    return [sum(expert_nbytes[e] for e in first if base_users[e] == 1) for first in firsts]


def _firsts(
    residents: Sequence[Set[ExpertKey]], routes: Sequence[Sequence[frozenset[ExpertKey]]]
) -> list[frozenset[ExpertKey]]:
    """Each session's first token's experts that were not resident when its block was drafted."""
    return [(own[0] - resident) if own else frozenset() for resident, own in zip(residents, routes, strict=True)]
