"""pdflash: serve Mixture-of-Experts models with offloaded experts and DFlash speculative decoding."""

from pdflash.engine.async_engine import AsyncEngine, EngineOverloadedError
from pdflash.engine.config import EngineConfig
from pdflash.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineConfig", "EngineOverloadedError", "SamplingParams"]
__version__ = "0.1.0"
