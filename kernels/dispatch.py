"""Chooses the implementation of each kernel: Triton on CUDA, the torch reference elsewhere.

The setting `PDFLASH_KERNELS` (`auto`, `triton`, `torch`) overrides the choice; tests force
`triton` on the CPU under `TRITON_INTERPRET=1`. Triton modules are imported only when chosen,
so `import kernels` does not import triton.
"""

from __future__ import annotations

import os

import torch

from kernels.grouped_swiglu import grouped_swiglu_reference
from kernels.mxfp4 import mxfp4_grouped_swiglu_reference, mxfp4_grouped_swiglu_triton
from kernels.routing import Routing, route_reference

BACKENDS = ("auto", "triton", "torch")


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
        from kernels.triton_routing import route_triton

        return route_triton(router_logits, top_k, normalize)
    return route_reference(router_logits, top_k, normalize)


def grouped_swiglu(x, routing, gate, up, down, slot_of_expert, out) -> None:
    if backend(x.device) == "triton":
        from kernels.triton_swiglu import grouped_swiglu_triton

        grouped_swiglu_triton(x, routing, gate, up, down, slot_of_expert, out)
    else:
        grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, out)


def mxfp4_grouped_swiglu(
    x, routing, gate_blocks, gate_scales, up_blocks, up_scales, down_blocks, down_scales,
    slot_of_expert, out, gate_bias=None, up_bias=None, down_bias=None,
) -> None:
    """Grouped SwiGLU over MXFP4 experts; arguments as `mxfp4.mxfp4_grouped_swiglu_reference`."""
    impl = (
        mxfp4_grouped_swiglu_triton if backend(x.device) == "triton"
        else mxfp4_grouped_swiglu_reference
    )
    impl(
        x, routing, gate_blocks, gate_scales, up_blocks, up_scales, down_blocks, down_scales,
        slot_of_expert, out, gate_bias, up_bias, down_bias,
    )
