"""A checkpoint's `generation_config.json`: the sampling defaults a request that omits them gets.

Owns reading the Hugging Face file into SamplingParams fields (vLLM's convention: the
temperature, top_p, top_k, min_p and repetition_penalty it sets). Must not decide
precedence: callers apply these only to fields a request or flag leaves unset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdflash.errors import CheckpointError
from pdflash.sampling import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(directory: Path | str) -> dict[str, Any]:
    """SamplingParams fields from `directory/generation_config.json` ({} without one)."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    defaults = {name: raw[name] for name in FIELDS if raw.get(name) is not None}
    if raw.get("do_sample") is False:  # transformers' greedy switch
        defaults["temperature"] = 0.0
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return defaults
