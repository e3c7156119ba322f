"""pdflash: serve Mixture-of-Experts models with offloaded experts and DFlash speculative decoding."""

from pdflash.sampling import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
