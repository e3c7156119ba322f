"""Where prompts prefill: the rule's table and the configuration's check."""

import pytest

from pdflash.engine.config import EngineConfig
from pdflash.engine.prefill_mode import prefill_waits_for_verify, prefills_ride_verifies


@pytest.mark.parametrize(
    ("choice", "offloaded", "drafts", "rides"),
    [
        ("auto", True, False, True),
        ("auto", False, False, False),
        ("auto", False, True, True),
        ("verify", False, False, True),
        ("alone", True, True, False),
    ],
)
def test_auto_prefills_inside_verifies_with_offloaded_experts_or_a_drafter(choice, offloaded, drafts, rides):
    assert prefills_ride_verifies(choice, offloaded=offloaded, drafts=drafts) is rides


def test_a_prefill_waits_for_a_verify_only_while_it_rides_them_and_someone_is_in_rounds():
    assert prefill_waits_for_verify(rides=True, sequences_in_rounds=3)
    assert not prefill_waits_for_verify(rides=True, sequences_in_rounds=0)  # no verify is coming
    assert not prefill_waits_for_verify(rides=False, sequences_in_rounds=3)


def test_an_unknown_prefill_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="prefill_mode='inline' is not one of 'auto', 'verify', 'alone'"):
        EngineConfig(prefill_mode="inline")
    with pytest.raises(ValueError, match="'auto', 'verify', 'alone'"):
        prefills_ride_verifies("both", offloaded=True, drafts=False)
