"""Expert kernels for the verify block: routing and grouped expert SwiGLU.

Each kernel has a plain-torch reference beside its Triton implementation; the functions
exported here dispatch between them (see `kernels.dispatch`).
"""

from kernels.dispatch import backend, grouped_swiglu, route
from kernels.routing import Routing

__all__ = ["Routing", "backend", "grouped_swiglu", "route"]
