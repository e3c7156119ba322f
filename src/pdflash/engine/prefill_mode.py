"""Where a prompt's prefill runs: alone on the target lane, or inside the next batched verify.

Owns the rule and the moment a waiting prefill is released to run alone. Behind a link, a
prompt's prefill routes its tokens through nearly every expert (the bundled pair with 41% of
its experts cached: 8.3 MB a lone prefill, about 20 decode tokens' bytes), and a prefill run
alone between two verifies fetches those experts while no seat verifies, then the next
verify fetches its own union again. Inside the next batched verify (one forward over the
verify blocks and the prompts; pdflash.spec.speculator.Speculator.verify_and_begin) the
experts both route to cross the link once. When sequences leave their seats rounds apart
(speculative ones do), their successors otherwise prefill one by one: with 64 requests over
16 clients plain decoding ran 1.3x faster than adaptive speculation (docs/benchmarks.md).

Resident, riding saves no bytes, but with a drafter it saves calls: a prefill run alone is
one more target call between two verifies, and its sequence then drafts alone, a drafter
call of its own, apart from the seats that just verified. Riding, the newcomer's prefill is
part of the next verify and it drafts with that batch (resident adaptive against prefilling
alone, c = 4 / 16 / 32: 1.06x / 1.06x / 1.03x with the drafter on the target's lane at 2
threads, 1.02x / 1.10x / 1.06x with a lane of its own at 1 thread each; docs/engine.md).

"verify": a prefill waits for the next verify launch while any seated sequence is in its
rounds (each of them ends in a verify or an exit, so the wait is bounded), and runs alone
once none is. "alone": as soon as the target lane frees. "auto": "verify" with experts behind
a link or with a drafter; resident plain decoding prefills alone (riding saves neither bytes
nor drafter calls there: 0.97x and 1.01x at c = 16, 1.03x at 32, within noise). Must not run
anything: the engine's prefill lane and the pacer (and the simulator) ask.
"""

from __future__ import annotations

PREFILL_MODES = ("auto", "verify", "alone")


def prefills_ride_verifies(choice: str, *, offloaded: bool, drafts: bool) -> bool:
    """Whether waiting prefills run inside the next batched verify (see the module's rule)."""
    if choice not in PREFILL_MODES:
        raise ValueError(f"prefill_mode={choice!r} is not one of {', '.join(map(repr, PREFILL_MODES))}")
    if choice != "auto":
        return choice == "verify"
    return offloaded or drafts


def prefill_waits_for_verify(*, rides: bool, sequences_in_rounds: int) -> bool:
    """True: a queued prefill waits for the next verify launch to take it along."""
    return rides and sequences_in_rounds > 0
