"""Chooses the implementation of each kernel: Triton on CUDA, the torch reference elsewhere.

The setting `PDFLASH_KERNELS` (`auto`, `triton`, `torch`) overrides the choice; tests force
`triton` on the CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os

import torch

from kernels.grouped_swiglu import grouped_swiglu_reference
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
    return route_reference(router_logits, top_k, normalize)


def grouped_swiglu(x, routing, gate, up, down, slot_of_expert, out) -> None:
    grouped_swiglu_reference(x, routing, gate, up, down, slot_of_expert, out)
