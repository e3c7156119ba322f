"""API errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Owns the error type every surface raises for a bad request and its JSON body. Must not
touch the engine: callers translate engine exceptions with `from_engine_error`.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from pdflash.errors import EngineClosedError, EngineOverloadedError

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code="overloaded", headers={"Retry-After": "1"})


def from_engine_error(error: Exception, *, param_of: dict[str, str] | None = None) -> APIError:
    """The APIError for an exception `engine.generate()` raised while validating or queuing.

    `param_of` maps the first word of a validation message (a SamplingParams field) to the
    request field the client sent, so `param` names what the client must change; other
    messages that mention the prompt get `param_of["prompt"]`.
    """
    if isinstance(error, EngineOverloadedError):
        return overloaded(str(error))
    if isinstance(error, EngineClosedError):
        return APIError(503, str(error), type=SERVER_ERROR, code="engine_closed")
    if isinstance(error, (ValueError, TypeError)):
        message, param_of = str(error), param_of or {}
        first = message.split(maxsplit=1)[0].split("=", 1)[0] if message else ""  # "temperature=-1 is ..."
        param = param_of.get(first) or (param_of.get("prompt") if "prompt" in message else None)
        return invalid(message, param=param)
    raise error
