"""What a launch prefetches (pdflash.engine.prefetching): hand-worked cases of the certainty and its rule."""

from __future__ import annotations

import pytest

from pdflash.engine.prefetching import launch_certainty, launch_prefetches
from pdflash.spec.projection import Projection

A, B, C, D = (0, 1), (0, 2), (1, 3), (1, 4)


def scored(chances: dict, threshold: float = 0.3) -> Projection:
    return Projection(frozenset(e for e, p in chances.items() if p > threshold), chances)


def test_alone_a_verify_prefetches_only_what_it_is_likely_enough_to_route():
    # B (0.5) is in the charged union but a coin flip: fetching it on demand costs no more bytes
    assert launch_prefetches([scored({A: 0.9, B: 0.5, C: 0.2})], 0.7) == [frozenset({A})]
    assert launch_prefetches([scored({A: 0.9, B: 0.5})], certainty=0.5) == [frozenset({A, B})]


def test_verifies_that_share_an_expert_make_it_likely_together():
    # 1 - 0.5 * 0.5 = 0.75 >= 0.7: prefetched once, claimed by the first of equals;
    # 1 - 0.6 * 0.6 = 0.64 < 0.7: left to the forward that routes it
    first, second = launch_prefetches([scored({A: 0.5, C: 0.4}), scored({A: 0.5, C: 0.4})], 0.7)
    assert (first, second) == (frozenset({A}), frozenset())


def test_a_launch_prefetches_only_from_its_projected_unions():
    # D is below each verify's threshold (0.3): 1 - 0.75^5 = 0.76 together, but never projected,
    # so never charged; it is fetched on demand if routed
    many = [scored({A: 0.8, D: 0.25}) for _ in range(5)]
    assert frozenset().union(*launch_prefetches(many, 0.7)) == {A}
    # a sure expert of one verify counts what the others scored below their thresholds
    assert launch_prefetches([scored({B: 0.6}), scored({B: 0.3})], 0.7) == [frozenset({B}), frozenset()]


def test_the_verify_most_likely_to_route_an_expert_claims_it():
    low, high = launch_prefetches([scored({A: 0.3, B: 0.8}), scored({A: 0.65, D: 0.95})], 0.7)
    assert low == frozenset({B})
    assert high == frozenset({A, D})  # 1 - 0.7 * 0.35 = 0.755


def test_a_projection_without_probabilities_counts_its_union_as_certain():
    plain = Projection(frozenset({A, B}))
    assert launch_prefetches([plain, scored({B: 0.9, C: 0.95})], 0.7) == [frozenset({A, B}), frozenset({C})]
    assert launch_prefetches([], 0.7) == []
    assert launch_prefetches([Projection(frozenset())], 0.7) == [frozenset()]


def test_the_certainty_is_the_link_s_share_of_a_launch():
    assert launch_certainty(100, 10.0, 10.0) == 0.5  # 10 s of copies beside 10 s of compute
    assert launch_certainty(1_400, 100.0, 1.0) == 14 / 15  # link-bound (R = 14): nearly sure only
    assert launch_certainty(100, 1e6, 1.0) < 1e-3  # a fast link: all that was projected
    assert launch_certainty(0, 10.0, 1.0) == 0.0  # nothing to copy
    assert launch_certainty(100, None, 1.0) == 0.0  # copies take no time
    assert launch_certainty(100, 10.0, None) == 0.0  # no verify timed yet: prefetch the unions whole


def test_at_certainty_0_a_launch_prefetches_its_unions_whole():
    projections = [scored({A: 0.9, B: 0.35, C: 0.1}), Projection(frozenset({D}))]
    assert launch_prefetches(projections, 0.0) == [frozenset({A, B}), frozenset({D})]


def test_the_certainty_is_a_probability():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="prefetch certainty must be in"):
            launch_prefetches([scored({A: 0.9})], certainty=bad)
