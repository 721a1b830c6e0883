"""OpenAI's error envelope, and the two kinds of failure it reports.

    RequestError   the request is at fault: 400, ``param`` names the field
    OpenAIError    anything else: 404 model, 503 queue full / aborted, 500 engine dead

Every invalid request ends as a ``RequestError`` raised where its field is checked;
nothing a client sends may reach the engine unchecked, since an exception in the
engine core's step is fatal to every request in flight.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from loom.async_llm import EngineDeadError, QueueFullError, RequestAbortedError
from loom.input_processor import InvalidInputError
from loom.outputs import CompletionOutput


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class OpenAIError(Exception):
    def __init__(self, status_code: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class RequestError(OpenAIError):
    """A 400: the request field ``param`` (None: the body as a whole) is wrong."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)

    @classmethod
    def from_invalid_input(cls, error: InvalidInputError) -> RequestError:
        """The engine's input processor names the field itself."""
        return cls(str(error), param=error.param, code=error.code)


def model_not_found(requested: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{requested}` does not exist.", param="model",
                       code="model_not_found")


def engine_error(error: Exception) -> OpenAIError:
    """A failure of the engine (not of the request) as an OpenAIError."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, QueueFullError):
        return OpenAIError(503, str(error), "service_unavailable", code="queue_full",
                           headers={"Retry-After": "1"})
    if isinstance(error, RequestAbortedError):
        return OpenAIError(503, f"the request was aborted: {error}", "service_unavailable",
                           code="aborted")
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"the engine is dead: {error}", "server_error", code="engine_dead")
    return OpenAIError(500, f"{type(error).__name__}: {error}", "server_error")


def raise_if_failed(seq: CompletionOutput) -> None:
    """A sequence the engine finished with finish_reason "error" fails its request."""
    if seq.finish_reason == "error":
        raise OpenAIError(500, f"the engine failed this request: {seq.stop_reason}",
                          "server_error")
