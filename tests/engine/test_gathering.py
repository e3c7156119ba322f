"""What a launch waits for (pacer._gather_s), resident: the rounds a verify just ended are on
their way to a demand, due when their drafts are, or after the loop's hand-offs if plain."""

from __future__ import annotations

import time
from types import SimpleNamespace

import anyio
import pytest

from pdflash.engine.pacer import VerifyPacer
from pdflash.engine.sequence import SequenceState
from pdflash.engine.speculation import SpeculationPlanner
from pdflash.spec.projection import ProjectionQuality
from pdflash.spec.session import RoundTrace


def _trace(tokens: int) -> RoundTrace:
    quality = ProjectionQuality(coverage=1.0, coverage_bytes=1.0, waste_bytes=0)
    return RoundTrace(
        start=0, tokens=tokens, acceptance_length=1, expert_bytes=0, fetch_bytes=0, actual_bytes=0, quality=quality
    )


def _measured_planner() -> SpeculationPlanner:
    """Resident: a verify's fixed seconds 0.4 s (+ 10 ms a token), a drafter call 0.4 s + 0.1 s a
    sequence, 0.1 s of hand-offs between rounds (slow, so no pause of the test's host decides it)."""
    planner = SpeculationPlanner("adaptive", 8, link_bytes_per_s=None)
    for tokens in (1, 8) * 3:
        planner.observe_verify([_trace(tokens)], 0.4 + 0.01 * tokens)
        planner.refit()
    for sequences in (1, 4) * 2:
        planner.observe_draft(sequences, 0.4 + 0.1 * sequences)
    planner.observe_idle(0.1)
    assert planner.verify_fixed_s == pytest.approx(0.4) and planner.draft_call_s(4) == pytest.approx(0.8)
    return planner


def _seq(last_block: int, *, ended: bool) -> SimpleNamespace:
    """A sequence stand-in with what the pacer reads: in VERIFY, its verify ended (on its way to
    its next demand) or admitted and waiting to launch."""
    done = anyio.Event()
    if ended:
        done.set()
    return SimpleNamespace(
        state=SequenceState.VERIFY, verify_done=done, planned_block=last_block, drafted_at=0.0, draft=object()
    )


@pytest.mark.parametrize("last_block, waits", [(1, True), (8, False)])
def test_a_launch_waits_for_rounds_just_ended_if_plain_not_for_drafts_due_past_a_verifys_fixed_seconds(
    last_block, waits
):
    """Counted as drafts due in a drafter call's seconds (0.8 s for four, past the verify's fixed
    0.4 s), plain rounds that had just ended were left to a second launch, and once drafting had
    split the sequences into two cohorts, plain decoding kept taking turns on the lane (resident
    adaptive at c = 16 on the bundled pair: 692 launches of 8 where plain decoding made 383 of 15)."""
    planner = _measured_planner()
    admitted = [_seq(1, ended=False) for _ in range(4)]  # the next batch, registered while the last ran
    just_ended = [_seq(last_block, ended=True) for _ in range(4)]
    seqs = {i: s for i, s in enumerate(admitted + just_ended)}
    drafts = SimpleNamespace(lane=object(), working=False)  # the drafter's own lane
    pacer = VerifyPacer(None, None, object(), None, None, seqs, planner, drafts, None)
    pacer._next = admitted
    pacer._ended_at = time.perf_counter()
    wait_s = pacer._gather_s(admitted)
    assert (wait_s > 0) == waits, wait_s
    assert wait_s <= 0.1  # never past the hand-offs it expects


def test_cohorts_taking_turns_still_teach_the_planner_what_plain_rounds_hand_off_in():
    """The seconds between rounds were measured only when a launch held sequences of the one
    before: once plain rounds had split into cohorts taking turns (prompts prefilled one by one,
    or drafting for a while), none was, the estimate stayed 0 and no launch ever waited for the
    other cohort again (resident adaptive at c = 16 on the bundled pair, prompts prefilled alone:
    1,127 launches of 11, 4 and 1 against plain decoding's 383 of 16). Each plain round's own
    hand-off, from its verify's end to its demand, is measured whatever launched in between."""
    planner = SpeculationPlanner("adaptive", 8, link_bytes_per_s=None)
    pacer = VerifyPacer(None, None, object(), None, None, {}, planner, SimpleNamespace(lane=object()), None)
    pacer._last_ids = {"other cohort"}
    ended = time.perf_counter() - 1.0
    batch = [
        SimpleNamespace(request_id=i, planned_draft=1, verified_at=ended, drafted_at=ended + handoff_s)
        for i, handoff_s in enumerate((0.02, 0.05))
    ]
    pacer._observe_gap(batch)
    assert planner.idle_s == pytest.approx(0.05)  # the batch waited for its slowest hand-off
    drafted = [SimpleNamespace(request_id=9, planned_draft=8, verified_at=ended, drafted_at=ended + 0.5)]
    pacer._observe_gap(drafted)  # a drafted round's gap is its drafter's, priced apart
    assert planner.idle_s == pytest.approx(0.05)
