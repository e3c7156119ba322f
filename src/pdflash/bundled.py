"""The bundled trained pair (package data): a small Qwen3-MoE code model and its DFlash drafter.

They are the default model of `pdflash generate`, `pdflash serve` and
`AsyncEngine.from_pretrained()`; `docs/model-card.md` says how they were built.
"""

from __future__ import annotations

from pathlib import Path

MODELS = Path(__file__).resolve().parent / "models"
BUNDLED_TARGET = MODELS / "pdflash-moe-code"
BUNDLED_DRAFTER = MODELS / "pdflash-moe-code-dflash"


def default_target() -> Path:
    return BUNDLED_TARGET


def default_drafter(target: Path) -> Path | None:
    """The bundled drafter when `target` is the bundled target; no drafter for any other target."""
    return BUNDLED_DRAFTER if Path(target).resolve() == BUNDLED_TARGET else None
