"""Engine configuration and the engine's stats snapshot: frozen values, validated once.

Owns what an operator sets (seats, queue, prefill budget, the four verify budgets, the charge
mode, the starvation guard) and what `AsyncEngine.stats()` reports. Must not touch model
work or scheduling state.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from pdflash.checks import require_int
from pdflash.engine.admission import require_fits_cap
from pdflash.engine.charging import ChargeMode, largest_block_union_bytes
from pdflash.engine.scheduler import VerifyScheduler
from pdflash.target.experts import ExpertKey


def _charge_mode(value: ChargeMode | str) -> ChargeMode:
    return ChargeMode.parse(value)


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

    @property
    def two_dimensional(self) -> bool:
        return self.verify_byte_budget is not None

    def verify_scheduler(self, block_tokens: int, byte_map: Mapping[ExpertKey, int], top_k: int) -> VerifyScheduler:
        """The verify scheduler these settings describe, after checking that their caps can admit a
        full block of `block_tokens` (liveness); token-only (no byte budgets): every block fits a tick."""
        if self.verify_byte_budget is None:
            budget = self.max_num_seqs * block_tokens
            return VerifyScheduler(token_budget=budget, token_cap=budget, barrier_after=self.barrier_after)
        assert self.verify_token_budget and self.verify_token_cap and self.verify_byte_cap  # all four (post-init)
        block = f"one verify block of {block_tokens} tokens"
        require_fits_cap("verify_token_cap", self.verify_token_cap, block_tokens, block)
        largest = largest_block_union_bytes(byte_map, block_tokens, top_k)
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
        )


@attrs.frozen(kw_only=True)
class EngineStats:
    live_sequences: int  # admitted and not yet released (holding KV)
    sequences_by_state: dict[str, int]  # sequences not yet released, by lifecycle state
    waiting: int  # queued, not yet admitted
    pending_demands: int  # verify demands the scheduler holds (waiting or in flight)
    kv_bytes: int  # target + drafter KV cache bytes held by live sessions
    claimed_experts: int  # experts of route-ahead prefetches whose verify has not run yet
    requests: int  # accepted by generate()
    finished: int
    aborted: int
    failed: int
    generated_tokens: int  # tokens streamed, all requests
    verify_rounds: int  # per-sequence verify rounds
    steps: int  # engine steps run
    mean_acceptance_length: float  # tokens emitted per verify round, bonus included
    verify_batch_sizes: dict[int, int]  # sequences per batched verify -> how many such batches
    admission_wait_p50_s: float | None  # verify admission wait (scheduler window)
    admission_wait_p99_s: float | None
    model_s: float  # time the model lane spent in forwards
    prefetch_requests: int  # route-ahead prefetches issued
    prefetch_errors: int
    provider: dict | None  # the expert provider's own stats, if it has any

    def as_dict(self) -> dict:
        return attrs.asdict(self)
