"""When a free seat waits for a sequence about to leave: hand-worked cases of the pure rule."""

import pytest

from pdflash.engine.seating import prefill_waits, seconds_to_limit


def test_seconds_to_limit_is_the_remaining_tokens_at_the_rate_streamed_so_far():
    # 11 tokens streamed in 1 s after the first: 0.1 s a token; 3 left -> 0.3 s
    assert seconds_to_limit(3, 11, 1.0) == pytest.approx(0.3)
    assert seconds_to_limit(0, 11, 1.0) == 0.0
    assert seconds_to_limit(5, 1, 0.0) is None  # one token: no rate yet


def test_a_prompt_waits_only_for_a_sequence_that_leaves_sooner_than_a_prefill_takes():
    assert prefill_waits(link=True, prefill_s=0.35, to_limit_s=[2.0, 0.2])
    assert not prefill_waits(link=True, prefill_s=0.35, to_limit_s=[2.0, 0.5])
    assert not prefill_waits(link=True, prefill_s=0.35, to_limit_s=[None, None])
    assert not prefill_waits(link=True, prefill_s=0.35, to_limit_s=[])


def test_without_a_link_or_a_measured_prefill_no_prompt_waits():
    assert not prefill_waits(link=False, prefill_s=0.35, to_limit_s=[0.0])  # resident: prefills cost compute only
    assert not prefill_waits(link=True, prefill_s=None, to_limit_s=[0.0])
