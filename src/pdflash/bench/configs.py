"""The configurations a sweep compares (B0-B3 of BENCHMARKS.md) and the 2-D budgets B2 uses.

Owns the names `--configs` accepts and what each means for an engine or a simulation
(drafter or not, offloaded or resident, token-only or 2-D verify budgets). Later modes add
entries here. Must not build engines: runners read these values.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class BenchConfig:
    name: str  # what --configs and every table call it
    label: str  # the baseline it is (BENCHMARKS.md)
    speculative: bool  # DFlash drafter on (else autoregressive, a block of 1)
    offloaded: bool  # experts behind the device cache and the (emulated) link
    two_dimensional: bool  # verify admission by tokens and expert bytes (else token-only)
    derived: bool = False  # 2-D budgets derived per tick by the engine (else the fixed `two_d_budgets`)
    speculation: str = "fixed"  # "adaptive": the block per sequence and round (pdflash.spec.policy)
    verify_order: str = "yield"  # the order a 2-D tick offers waiting verifies (pdflash.engine.ordering)
    projector: str | None = None  # route projector (`name@projector`); None: the engine's default

    @property
    def scheduling(self) -> str:
        """The engine's EngineConfig.scheduling for this configuration."""
        if not self.two_dimensional:
            return "token-only"
        return "derived" if self.derived else "fixed"


CONFIGS = {
    c.name: c
    for c in (
        BenchConfig(name="ar", label="B0", speculative=False, offloaded=True, two_dimensional=False),
        BenchConfig(name="dflash-token", label="B1", speculative=True, offloaded=True, two_dimensional=False),
        BenchConfig(
            name="dflash-2d",
            label="B2",
            speculative=True,
            offloaded=True,
            two_dimensional=True,
            verify_order="arrival",
        ),
        BenchConfig(name="resident", label="B3", speculative=True, offloaded=False, two_dimensional=False),
        # plain decoding with every expert resident: what resident speculation must not lose to
        BenchConfig(name="resident-ar", label="B3p", speculative=False, offloaded=False, two_dimensional=False),
        BenchConfig(
            name="dflash-derived", label="B2d", speculative=True, offloaded=True, two_dimensional=True, derived=True
        ),
        # the engine's defaults: adaptive speculation, working-set budgets, yield order
        BenchConfig(
            name="adaptive",
            label="B4",
            speculative=True,
            offloaded=True,
            two_dimensional=True,
            derived=True,
            speculation="adaptive",
        ),
        BenchConfig(
            name="adaptive-token",
            label="B4t",
            speculative=True,
            offloaded=True,
            two_dimensional=False,
            speculation="adaptive",
        ),
        BenchConfig(
            name="resident-adaptive",
            label="B3a",
            speculative=True,
            offloaded=False,
            two_dimensional=False,
            speculation="adaptive",
        ),
    )
}
ALIASES = {c.label.lower(): c.name for c in CONFIGS.values()}
BASELINES = ("ar", "dflash-token", "dflash-2d", "resident")  # B0-B3 of BENCHMARKS.md


def parse_configs(text: str) -> list[BenchConfig]:
    """`ar,dflash-2d` or `b0,b2` (comma-separated) -> configurations, in the order given.

    `dflash-2d@route-head` is that configuration with that route projector (any of
    pdflash.spec.projection.PROJECTORS), so projectors compare side by side in one run.
    """
    from pdflash.spec.projection import PROJECTORS

    chosen = []
    for raw in text.split(","):
        name, _, projector = raw.strip().lower().partition("@")
        key = ALIASES.get(name, name)
        if key not in CONFIGS:
            valid = ", ".join(f"{c.name} ({c.label})" for c in CONFIGS.values())
            raise ValueError(f"--configs: {raw.strip()!r} is not a configuration; valid: {valid}")
        config = CONFIGS[key]
        if projector:
            if projector not in PROJECTORS:
                raise ValueError(
                    f"--configs: {raw.strip()!r} names projector {projector!r}; valid: {', '.join(PROJECTORS)}"
                )
            config = attrs.evolve(
                config, name=f"{config.name}@{projector}", label=f"{config.label}@{projector}", projector=projector
            )
        chosen.append(config)
    return chosen


def two_d_budgets(*, max_num_seqs: int, block_size: int, cache_bytes: int, largest_union_bytes: int) -> dict:
    """B2's verify budgets: every live block's tokens per tick, and per tick as many marginal
    expert bytes as the device cache holds (carry up to twice that, at least one block's
    largest union, so every demand stays admissible)."""
    tokens = max_num_seqs * block_size
    byte_budget = max(1, cache_bytes)
    return {
        "verify_token_budget": tokens,
        "verify_token_cap": tokens,
        "verify_byte_budget": byte_budget,
        "verify_byte_cap": max(largest_union_bytes, 2 * byte_budget),
    }
