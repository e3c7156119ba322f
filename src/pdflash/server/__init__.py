"""HTTP and websocket serving: OpenAI-compatible endpoints, /ws streaming, /metrics, the demo page.

`create_app(engine, ServerSettings(...))` returns a Starlette app whose lifespan runs the
engine; `pdflash serve` runs it under uvicorn; `BackgroundServer` runs it on a loopback
port in a thread (tests, examples, notebooks).
"""

from pdflash.server.app import create_app
from pdflash.server.background import BackgroundServer
from pdflash.server.state import ServerSettings

__all__ = ["BackgroundServer", "ServerSettings", "create_app"]
