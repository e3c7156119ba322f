"""When a waiting request takes a free seat: at once, or with the prompt of the seat about to free.

Owns the one seating decision beyond arrival order and free seats. With experts behind a link, a
prompt's prefill routes its tokens through nearly every expert, so in a small cache it fetches
about the same bytes whether it prefills one prompt or several, and meanwhile no seat verifies
(the bundled pair's recorded routes with 41% of its experts cached, simulated: a lone prompt's
prefill fetches 8.3 MB, four together 9.9 MB, each about 20 decode tokens' bytes). A sequence
reaching its length limit frees a seat whose next request then arrives alone. So while a seated
sequence is expected to reach its limit sooner than a prefill takes, a waiting prompt waits for
it: the two are prefilled together, and the link carries the experts once. Resident experts, or
a link of unknown rate: never.
Must not seat, prefill or measure: the engine (and the simulator) ask `prefill_waits`.
"""

from __future__ import annotations

from collections.abc import Iterable


def seconds_to_limit(remaining_tokens: int, streamed_tokens: int, since_first_token_s: float) -> float | None:
    """A sequence's expected seconds until its length limit: its remaining tokens at the seconds per
    token it has streamed at since its first (None before a second token: no rate yet)."""
    if streamed_tokens < 2:
        return None
    return max(0, remaining_tokens) * since_first_token_s / (streamed_tokens - 1)


def prefill_waits(*, link: bool, prefill_s: float | None, to_limit_s: Iterable[float | None]) -> bool:
    """True: hold the next waiting prompt. `prefill_s`: what the last prefill took (None before one);
    `to_limit_s`: each seated sequence's `seconds_to_limit`."""
    if not link or prefill_s is None:
        return False
    return any(s is not None and s < prefill_s for s in to_limit_s)
