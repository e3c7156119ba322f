"""Chooses the implementation of each kernel: Triton on CUDA, plain torch elsewhere.

Off CUDA, a dense expert SwiGLU that routes to many experts runs `grouped_swiglu_torch`
(grouped matmuls) and one that routes to few runs the per-expert loop of the reference, which
has less bookkeeping; routing and MXFP4 experts run their torch references.

The setting `PDFLASH_KERNELS` (`auto`, `triton`, `torch`) overrides the choice; tests force
`triton` on the CPU under `TRITON_INTERPRET=1`. Triton modules are imported only when chosen,
so `import pdflash.kernels` does not import triton.
"""

from __future__ import annotations

import os

import torch

from pdflash.kernels.clamped_swiglu import clamped_swiglu_reference, clamped_swiglu_triton
from pdflash.kernels.grouped_swiglu import grouped_swiglu_reference, grouped_swiglu_torch
from pdflash.kernels.mxfp4 import mxfp4_grouped_swiglu_reference, mxfp4_grouped_swiglu_triton
from pdflash.kernels.routing import Routing, route_reference

BACKENDS = ("auto", "triton", "torch")
# Routed experts from which grouped matmuls beat the per-expert loop on the CPU. Measured on
# the bundled model's own verify blocks (8 tokens routing 5-19 of 32 experts per layer, median
# 11; 2 threads): the loop wins below 11 (256 vs 343 µs at 5) and grouped_mm from 11 up
# (484 vs 473 µs at 11, 626 vs 537 µs at 16).
GROUPED_FROM_EXPERTS = 11


def backend(device: torch.device) -> str:
    """`triton` or `torch` for tensors on `device`, honouring PDFLASH_KERNELS."""
    choice = os.environ.get("PDFLASH_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"PDFLASH_KERNELS={choice!r} is not one of {BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    if backend(router_logits.device) == "triton":
        from pdflash.kernels.triton_routing import route_triton

        return route_triton(router_logits, top_k, normalize)
    return route_reference(router_logits, top_k, normalize)


def grouped_swiglu(x, routing, gate, up, down, slot_of_expert, out) -> None:
    if backend(x.device) == "triton":
        from pdflash.kernels.triton_swiglu import grouped_swiglu_triton

        grouped_swiglu_triton(x, routing, gate, up, down, slot_of_expert, out)
    elif int(routing.union_mask.sum()) >= GROUPED_FROM_EXPERTS:
        grouped_swiglu_torch(x, routing, gate, up, down, slot_of_expert, out)
    else:
        grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, out)


def mxfp4_grouped_swiglu(
    x,
    routing,
    gate_blocks,
    gate_scales,
    up_blocks,
    up_scales,
    down_blocks,
    down_scales,
    slot_of_expert,
    out,
    gate_bias=None,
    up_bias=None,
    down_bias=None,
) -> None:
    """Grouped SwiGLU over MXFP4 experts; arguments as `mxfp4.mxfp4_grouped_swiglu_reference`."""
    impl = mxfp4_grouped_swiglu_triton if backend(x.device) == "triton" else mxfp4_grouped_swiglu_reference
    impl(
        x,
        routing,
        gate_blocks,
        gate_scales,
        up_blocks,
        up_scales,
        down_blocks,
        down_scales,
        slot_of_expert,
        out,
        gate_bias,
        up_bias,
        down_bias,
    )


def clamped_swiglu(
    x,
    routing,
    gate_up,
    gate_up_scales,
    gate_up_bias,
    down,
    down_scales,
    down_bias,
    slot_of_expert,
    out,
    *,
    limit,
    alpha,
) -> None:
    """gpt-oss's expert MLP; arguments as `clamped_swiglu.clamped_swiglu_reference`."""
    impl = clamped_swiglu_triton if backend(x.device) == "triton" else clamped_swiglu_reference
    impl(
        x,
        routing,
        gate_up,
        gate_up_scales,
        gate_up_bias,
        down,
        down_scales,
        down_bias,
        slot_of_expert,
        out,
        limit=limit,
        alpha=alpha,
    )
