"""Shadow drafts: drafts no verify reads, checked against the tokens the target commits after them."""

from __future__ import annotations

import pytest

from pdflash.bundled import default_drafter, default_target
from pdflash.sampling import SamplingParams
from pdflash.spec.drafter import load_drafter
from pdflash.spec.shadow import Outcome, ShadowCheck, ShadowReader
from pdflash.spec.speculator import Speculator
from pdflash.target.loader import load_target


def plain(reader: ShadowReader, token: int, *, finished: bool = False, drafted: bool = False, shadow=()):
    """A plain round: one token verified, no drafts accepted, `token` committed."""
    return reader.after_round(
        drafted=drafted, verified=1, accepted=0, shadow=shadow, committed=(token,), finished=finished
    )


def test_a_plain_rounds_shadow_drafts_are_read_off_the_tokens_it_commits_next():
    reader = ShadowReader()
    assert plain(reader, 7, drafted=True, shadow=(7, 8, 9)) == []  # draft 1 matched: read on
    assert reader.check == ShadowCheck((8, 9), 1)
    assert plain(reader, 8) == []
    assert plain(reader, 4) == [Outcome(block=4, accepted=2)]  # draft 3 refuted: a verify of 4 accepting 2
    assert reader.check is None
    assert plain(reader, 5) == []  # nothing open: nothing to say


def test_every_shadow_draft_matched_is_a_whole_block_accepted():
    reader = ShadowReader()
    assert plain(reader, 1, drafted=True, shadow=(1, 2)) == []
    assert plain(reader, 2) == [Outcome(block=3, accepted=2)]


def test_a_verified_block_whose_drafts_all_pass_goes_on_into_its_shadow_drafts():
    reader = ShadowReader()
    # a block of 3 (anchor + 2 drafts), both accepted, bonus 30; shadow drafts 30, 40 (block of 5)
    out = reader.after_round(
        drafted=True, verified=3, accepted=2, shadow=(30, 40), committed=(10, 20, 30), finished=False
    )
    assert out == [] and reader.check == ShadowCheck((40,), 3)  # the bonus matched the first shadow draft
    assert plain(reader, 41) == [Outcome(block=5, accepted=3)]


def test_a_rejected_draft_voids_the_shadow_drafts_after_it():
    reader = ShadowReader()
    out = reader.after_round(drafted=True, verified=3, accepted=1, shadow=(30, 40), committed=(10, 99), finished=False)
    assert out == [Outcome(block=3, accepted=1)] and reader.check is None


def test_a_block_without_shadow_drafts_reports_its_verify_and_a_plain_one_nothing():
    reader = ShadowReader()
    assert reader.after_round(
        drafted=True, verified=4, accepted=3, shadow=(), committed=(1, 2, 3, 4), finished=False
    ) == [Outcome(block=4, accepted=3)]
    assert plain(reader, 1) == []


def test_an_open_check_ends_with_what_it_read_when_the_sequence_drafts_again_or_ends():
    reader = ShadowReader()
    plain(reader, 7, drafted=True, shadow=(7, 8, 9))
    # it drafts again before draft 2 is read: draft 1 matched, nothing more is known
    out = reader.after_round(drafted=True, verified=2, accepted=0, shadow=(), committed=(5,), finished=False)
    assert out == [Outcome(block=2, accepted=1), Outcome(block=2, accepted=0)]
    plain(reader, 7, drafted=True, shadow=(7, 8, 9))
    assert plain(reader, 8, finished=True) == [Outcome(block=3, accepted=2)]
    assert reader.check is None
    assert ShadowCheck((3,), 0).close() is None  # nothing matched: nothing known


@pytest.fixture(scope="module")
def pair():
    loaded = load_target(default_target())
    return loaded, load_drafter(default_drafter(default_target()), loaded.model)


def test_shadow_drafts_read_as_a_verify_of_the_same_block_accepts(pair):
    """The oracle: for greedy decoding, a plain round's shadow drafts, read off the tokens plain
    decoding commits, give exactly what verifying that whole block accepts (bundled trained pair,
    so that blocks are accepted in part)."""
    loaded, drafter = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    prompt = loaded.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")
    [session] = spec.begin_sessions([(prompt, SamplingParams(max_tokens=96))])
    block, seen = spec.block_size, []
    while len(session.emitted) + 2 * block < 96:
        before = session.snapshot()
        [whole] = spec.draft_rounds([session], [block])
        [verified] = spec.verify_rounds([session])
        session.restore(before)
        [shadowed] = spec.draft_rounds([session], [1], [block])
        assert shadowed.block == whole.block[:1] and shadowed.shadow == whole.block[1:]
        reader, outcomes = ShadowReader(), []
        committed = spec.verify_rounds([session])[0].accepted_ids
        outcomes += reader.after_round(
            drafted=True, verified=1, accepted=0, shadow=shadowed.shadow, committed=committed, finished=False
        )
        while reader.check is not None:
            [_] = spec.draft_rounds([session], [1])
            outcomes += plain(reader, spec.verify_rounds([session])[0].accepted_ids[0])
        assert outcomes == [Outcome(block=block, accepted=verified.accepted_drafts)]
        seen.append(verified.accepted_drafts)
    assert max(seen) >= 2 and min(seen) < block - 1, seen  # some blocks accepted far, some refuted early


def test_only_a_greedy_session_drafts_past_its_block(pair):
    loaded, drafter = pair
    spec = Speculator(loaded.model, drafter, expert_nbytes=loaded.expert_nbytes, projector="last-union")
    prompt = loaded.tokenizer.encode("import os\n")
    [sampled] = spec.begin_sessions([(prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=1))])
    with pytest.raises(ValueError, match="more only when greedy"):
        spec.draft_rounds([sampled], [2], [spec.block_size])
    [greedy] = spec.begin_sessions([(prompt, SamplingParams(max_tokens=3))])
    [draft] = spec.draft_rounds([greedy], [1], [spec.block_size])
    assert draft.drafted and len(draft.block) + len(draft.shadow) == 3  # cut where the request ends: 2 more tokens + 1
