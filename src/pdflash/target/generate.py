"""The synchronous autoregressive generate loop: the reference path every faster path must equal."""

from __future__ import annotations

import time

import attrs
import torch

from pdflash.measure import tokens_per_second
from pdflash.sampling import SamplingParams, sample
from pdflash.stopping import StopRule
from pdflash.target.model import Qwen3MoeModel


@attrs.frozen(kw_only=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # generated ids (prompt excluded)
    finish_reason: str  # "stop" | "length"
    acceptance_lengths: tuple[int, ...] = ()  # tokens committed per verify round (empty for AR)
    stats: dict = attrs.field(factory=dict)


def generate_autoregressive(model: Qwen3MoeModel, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    rule = StopRule.for_request(len(prompt_ids), params, model.config.max_positions, model.config.eos_token_ids)
    generator = params.generator(model.device)
    cache = model.new_cache()
    started = time.perf_counter()
    step = torch.tensor(prompt_ids, dtype=torch.int64)
    emitted: list[int] = []
    finish = None
    first_token_at: float | None = None
    while finish is None:
        logits = model.forward([step], [cache], last_logits_only=True).logits  # [1, V]
        token = int(sample(logits, params, generator)[0])
        first_token_at = first_token_at or time.perf_counter()
        kept, finish = rule.clip(len(emitted), [token])
        emitted += kept
        step = torch.tensor(kept, dtype=torch.int64)
    done = time.perf_counter()
    first = first_token_at if first_token_at is not None else done
    return GenerationResult(
        token_ids=tuple(emitted),
        finish_reason=finish,
        stats={
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": len(emitted),
            "elapsed_s": done - started,
            "ttft_s": first - started,
            "tokens_per_second": tokens_per_second(len(emitted), first, done),
        },
    )
