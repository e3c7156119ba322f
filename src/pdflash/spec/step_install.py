"""Installs compiled static-shape steps on a speculator's target and drafter, and warms them up.

Owns the bucket choice for a speculator (decode and verify token buckets, batch buckets up to
the engine's seats) and the warm-up order; the steps themselves live in `target.compiled` and
`spec.draft_steps`. A target family without static steps (gpt-oss) keeps its eager forward.
"""

from __future__ import annotations

import logging

import torch

from pdflash.spec.draft_steps import DraftSteps
from pdflash.spec.speculator import Speculator
from pdflash.target.compiled import StepBuckets, TargetSteps
from pdflash.target.model import Qwen3MoeModel

log = logging.getLogger(__name__)


def install_steps(
    speculator: Speculator,
    *,
    max_batch: int,
    compiled: bool = True,
    threads: tuple[int, int] | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Static-shape steps for batches of up to `max_batch` sessions; returns warm-up seconds by part.

    `threads`: the torch threads the target and drafter forwards will run with (the engine's
    lanes; 0 for the drafter = on the target's). Inductor's CPU kernels are built for a thread
    count, so each part warms up at its own, here, on the calling thread (default: its count).
    """
    target = speculator.target
    if not isinstance(target, Qwen3MoeModel):
        log.info("no compiled steps for the %s family; its forwards stay eager", target.config.family)
        return {}
    tokens = (1,) if speculator.drafter is None else tuple(sorted({1, speculator.block_size}))
    buckets = StepBuckets(tokens=tokens).upto(max_batch)
    target_threads, drafter_threads = threads or (torch.get_num_threads(), torch.get_num_threads())
    target.steps = TargetSteps(target, buckets, compiled=compiled)
    torch.set_num_threads(target_threads)
    seconds = {"target": target.steps.warm_up(target.new_cache, progress=progress)}
    if speculator.drafter is not None:
        drafter = speculator.drafter
        draft_buckets = StepBuckets(batch=buckets.batch, tokens=(speculator.block_size,))
        shared = (
            drafter.lm_head.data_ptr() == target.lm_head.data_ptr() and drafter.lm_head.shape == target.lm_head.shape
        )
        lm_head_t = target.steps.lm_head_t if shared else None  # one transposed copy, read warm by both
        drafter.steps = DraftSteps(drafter, draft_buckets, compiled=compiled, lm_head_t=lm_head_t)
        torch.set_num_threads(drafter_threads or target_threads)
        seconds["drafter"] = drafter.steps.warm_up(progress=progress)
    return seconds
