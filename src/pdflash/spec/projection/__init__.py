"""Route projection: which (layer, expert) pairs a drafted block's verify will route to.

`make_projector` builds one by name; docs/speculative.md measures each one's coverage, waste
and cost on the bundled pair.
"""

from __future__ import annotations

from pathlib import Path

from pdflash.spec.projection.base import (
    PROBABILITY_FLOOR,
    Projection,
    ProjectionQuality,
    Projector,
    routed_union,
    union_bytes,
)
from pdflash.spec.projection.passes import ExactProjector, LastUnionProjector, RouterPassProjector
from pdflash.spec.projection.route_head import ROUTE_HEAD_FILE, RouteHead, RouteHeadProjector

__all__ = [
    "PROBABILITY_FLOOR",
    "PROJECTORS",
    "ROUTE_HEAD_FILE",
    "Projection",
    "ProjectionQuality",
    "Projector",
    "RouteHead",
    "make_projector",
    "route_head_path",
    "routed_union",
    "union_bytes",
]

PROJECTORS = ("last-union", "router", "exact", "route-head")


def route_head_path(drafter_dir: Path | str | None) -> Path | None:
    """The route head file beside a drafter checkpoint, if there is one."""
    if drafter_dir is None:
        return None
    path = Path(drafter_dir) / ROUTE_HEAD_FILE
    return path if path.is_file() else None


def make_projector(name: str, *, route_head: RouteHead | None = None) -> Projector:
    """A projector by name; `route-head` needs the loaded head (RouteHead.load)."""
    simple: dict[str, type[LastUnionProjector | RouterPassProjector | ExactProjector]] = {
        p.name: p for p in (LastUnionProjector, RouterPassProjector, ExactProjector)
    }
    if name in simple:
        return simple[name]()
    if name == RouteHeadProjector.name:
        if route_head is None:
            raise ValueError(
                f"projector 'route-head' needs a trained route head ({ROUTE_HEAD_FILE} beside the drafter; "
                "`pdflash train-route-head` writes one)"
            )
        return RouteHeadProjector(route_head)
    raise ValueError(f"projector {name!r} is unknown; choose one of {', '.join(PROJECTORS)}")
