"""Engine configuration: frozen values, validated once.

Owns what an operator sets (seats, queue, prefill budget, the four verify budgets, the charge
mode, the starvation guard, the scheduling, speculation and ordering modes, the drafter's lane,
where prefills run) and the verify scheduler they imply. Must not touch model work or scheduling state; what
`AsyncEngine.stats()` reports is pdflash.engine.stats'.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from pdflash.checks import require_int
from pdflash.engine.admission import require_fits_cap
from pdflash.engine.charging import ChargeMode, largest_block_union_bytes
from pdflash.engine.lanes import DRAFTER_LANES
from pdflash.engine.ordering import ORDERS
from pdflash.engine.prefill_mode import PREFILL_MODES
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.spec.policy import SPECULATION
from pdflash.target.experts import ExpertKey


def _charge_mode(value: ChargeMode | str) -> ChargeMode:
    return ChargeMode.parse(value)


SCHEDULING = ("auto", "token-only", "derived", "fixed")
VERIFY_BUDGETS = ("verify_token_budget", "verify_byte_budget", "verify_token_cap", "verify_byte_cap")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Scheduling and backpressure settings, validated once."""

    max_num_seqs: int = 64  # live (admitted) sequences at most
    max_waiting: int = 256  # queued requests at most; one more raises EngineOverloadedError
    prefill_token_budget: int = 4096  # prompt tokens prefilled per step (a step's first prompt always fits)
    verify_token_budget: int | None = None  # tokens admitted to verify per tick
    verify_byte_budget: int | None = None  # expert bytes admitted per tick (charged per charge_mode)
    verify_token_cap: int | None = None  # carried tokens at most; >= one block
    verify_byte_cap: int | None = None  # carried bytes at most; >= one block's largest union
    charge_mode: ChargeMode = attrs.field(default=ChargeMode.MARGINAL, converter=_charge_mode)
    barrier_after: int = 4  # skipped ticks before a demand becomes a barrier (starvation guard)
    # how verify budgets are set: "fixed" (the four above), "derived" (every seat's block per
    # tick, carry capped at the cache: docs/engine.md), "token-only", or "auto": fixed when the
    # four are given, derived when experts are offloaded, else token-only
    scheduling: str = "auto"
    # how far each round speculates (pdflash.spec.policy): "adaptive" picks each sequence's block
    # per round (1 = plain decoding, the drafter skipped); "fixed" always drafts the full block
    speculation: str = "adaptive"
    # in what order a tick offers waiting verifies (pdflash.engine.ordering): "yield" (expected
    # tokens per byte, the guard's protected demands first) or "arrival"; token-only is arrival
    verify_order: str = "yield"
    # where the drafter runs (pdflash.engine.lanes.drafter_has_own_lane): "own" lane (drafts overlap
    # verifies), "shared" with the target, or "auto": shared only resident on a CPU of 2-3 threads
    drafter_lane: str = "auto"
    # where a prompt's prefill runs (pdflash.engine.prefill_mode): "verify" (inside the next batched
    # verify, whose experts it shares), "alone", or "auto": inside verifies when experts are offloaded
    # or a drafter is loaded
    prefill_mode: str = "auto"

    def __attrs_post_init__(self) -> None:
        for name in ("max_num_seqs", "max_waiting", "prefill_token_budget"):
            require_int(name, getattr(self, name))
        given = {name: getattr(self, name) for name in VERIFY_BUDGETS if getattr(self, name) is not None}
        if given and len(given) < len(VERIFY_BUDGETS):
            missing = [n for n in VERIFY_BUDGETS if n not in given]
            raise ValueError(f"verify budgets go all four or none (none = token-only): got {given}, missing {missing}")
        for name in VERIFY_BUDGETS:
            require_int(name, getattr(self, name), optional=True)
        require_int("barrier_after", self.barrier_after, 0)
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation={self.speculation!r} is not one of {', '.join(map(repr, SPECULATION))}")
        if self.verify_order not in ORDERS:
            raise ValueError(f"verify_order={self.verify_order!r} is not one of {', '.join(map(repr, ORDERS))}")
        if self.drafter_lane not in DRAFTER_LANES:
            raise ValueError(f"drafter_lane={self.drafter_lane!r} is not one of {', '.join(map(repr, DRAFTER_LANES))}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode={self.prefill_mode!r} is not one of {', '.join(map(repr, PREFILL_MODES))}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling={self.scheduling!r} is not one of {', '.join(map(repr, SCHEDULING))}")
        if self.scheduling == "fixed" and not given:
            raise ValueError(f"scheduling='fixed' needs the four verify budgets {list(VERIFY_BUDGETS)}")
        if self.scheduling in ("token-only", "derived") and given:
            raise ValueError(
                f"scheduling={self.scheduling!r} sets its own budgets; the four verify budgets go with 'fixed' "
                f"(or 'auto'), got {given}"
            )

    def resolved_scheduling(self, offloaded: bool) -> str:
        """'fixed', 'derived' or 'token-only': what 'auto' means for an engine with or without offloading."""
        if self.scheduling != "auto":
            return self.scheduling
        if self.verify_byte_budget is not None:
            return "fixed"
        return "derived" if offloaded else "token-only"

    @property
    def two_dimensional(self) -> bool:
        return self.verify_byte_budget is not None

    def verify_scheduler(
        self, mode: str, block_tokens: int, byte_map: Mapping[ExpertKey, int], top_k: int, cache_bytes: int = 0
    ) -> VerifyScheduler:
        """The verify scheduler of `mode` (see `resolved_scheduling`), after checking that its caps
        admit a full block of `block_tokens` (liveness). Token-only and derived: a tick's tokens
        hold every block of every seat; derived: the carry is capped at a cache's worth of bytes
        (`cache_bytes`, at least one block's largest union) and each tick's bytes are set per tick."""
        seats = self.max_num_seqs * block_tokens
        if mode == "token-only":
            return VerifyScheduler(token_budget=seats, token_cap=seats, barrier_after=self.barrier_after)
        block = f"one verify block of {block_tokens} tokens"
        largest = largest_block_union_bytes(byte_map, block_tokens, top_k)
        if mode == "derived":
            cap = max(cache_bytes, largest)
            return VerifyScheduler(
                token_budget=seats,
                token_cap=seats,
                byte_budget=cap,
                byte_cap=cap,
                barrier_after=self.barrier_after,
                charge_mode=self.charge_mode,
                byte_map=byte_map,
                order=self.verify_order,
            )
        assert self.verify_token_budget and self.verify_token_cap and self.verify_byte_cap  # all four (post-init)
        require_fits_cap("verify_token_cap", self.verify_token_cap, block_tokens, block)
        require_fits_cap(
            "verify_byte_cap", self.verify_byte_cap, largest, f"the largest expert union {block} can route"
        )
        return VerifyScheduler(
            token_budget=self.verify_token_budget,
            token_cap=self.verify_token_cap,
            byte_budget=self.verify_byte_budget,
            byte_cap=self.verify_byte_cap,
            barrier_after=self.barrier_after,
            charge_mode=self.charge_mode,
            byte_map=byte_map,
            order=self.verify_order,
        )
