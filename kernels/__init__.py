"""Expert kernels for the verify block: routing, grouped expert SwiGLU, MXFP4 experts.

Each kernel has a plain-torch reference beside its Triton implementation; the functions
exported here dispatch between them (see `pdflash.kernels.dispatch`).
"""

from pdflash.kernels.dispatch import backend, clamped_swiglu, grouped_swiglu, mxfp4_grouped_swiglu, route
from pdflash.kernels.mxfp4 import (
    mxfp4_expert_layout,
    mxfp4_expert_nbytes,
    pack_mxfp4,
    payload_nbytes,
    unpack_mxfp4,
)
from pdflash.kernels.routing import Routing

__all__ = [
    "Routing",
    "backend",
    "clamped_swiglu",
    "grouped_swiglu",
    "mxfp4_expert_layout",
    "mxfp4_expert_nbytes",
    "mxfp4_grouped_swiglu",
    "pack_mxfp4",
    "payload_nbytes",
    "route",
    "unpack_mxfp4",
]
