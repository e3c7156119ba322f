"""pdflash: serve Mixture-of-Experts models with offloaded experts and DFlash speculative decoding."""

from pdflash.engine.async_engine import AsyncEngine
from pdflash.engine.config import EngineConfig
from pdflash.errors import EngineOverloadedError
from pdflash.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineConfig", "EngineOverloadedError", "SamplingParams"]
__version__ = "0.1.0"
