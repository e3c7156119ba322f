"""The projectors that need nothing trained: the previous forward's union, and passes through the target."""

from __future__ import annotations

from pdflash.spec.projection.base import Projection, routed_union


class LastUnionProjector:
    """Assume the block routes like the session's previous target forward did."""

    name = "last-union"
    target_free = True

    def project(self, speculator, sessions, blocks):
        return [Projection(s.last_union) for s in sessions]


class RouterPassProjector:
    """A router-only pass of the drafted blocks through the target: attention and gates, experts skipped."""

    name = "router"
    target_free = False

    def project(self, speculator, sessions, blocks):
        target = speculator.target
        out = target.forward(blocks, [s.target_cache for s in sessions], skip_experts=True, commit=False)
        return [Projection(routed_union(r, target.config.moe_layer_ids)) for r in out.split(out.routed)]


class ExactProjector:
    """The true union: a full uncommitted forward of the block (as costly as the verify; an upper bound)."""

    name = "exact"
    target_free = False

    def project(self, speculator, sessions, blocks):
        target = speculator.target
        out = target.forward(blocks, [s.target_cache for s in sessions], commit=False)
        return [Projection(routed_union(r, target.config.moe_layer_ids)) for r in out.split(out.routed)]
