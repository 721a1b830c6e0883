"""What the completion and chat endpoints share: request validation, OpenAI errors,
sampling parameters, the context-length check, SSE framing and disconnect handling.

Every invalid request ends as an ``OpenAIError`` (a 4xx naming the field at fault);
nothing a client sends may reach the engine unchecked, since an exception in the
engine core's step is fatal to every request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loom.async_llm import EngineDeadError, QueueFullError, RequestAbortedError
from loom.entrypoints.openai.protocol import SamplingFields, error_body
from loom.input_processor import InvalidInputError
from loom.outputs import Logprob, RequestOutput
from loom.sampling_params import SamplingParams, StructuredOutputsParams

ModelT = TypeVar("ModelT", bound=BaseModel)

_SAMPLING_PARAMS_FIELD = re.compile(r"^SamplingParams\.(\w+) ")
# What vLLM reports for an impossible token (the sampler's LOGPROB_FLOOR; not imported,
# to keep torch out of the API process).
_LOGPROB_FLOOR = -9999.0


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def engine_error(error: Exception) -> OpenAIError:
    """A failure of the engine (not of the request) as an OpenAIError."""
    if isinstance(error, QueueFullError):
        return OpenAIError(503, str(error), "service_unavailable", code="queue_full",
                           headers={"Retry-After": "1"})
    if isinstance(error, RequestAbortedError):
        return OpenAIError(503, f"the request was aborted: {error}", "service_unavailable",
                           code="aborted")
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"the engine is dead: {error}", "server_error", code="engine_dead")
    return OpenAIError(500, f"{type(error).__name__}: {error}", "server_error")


def parse_body(model: type[ModelT], body: bytes) -> ModelT:
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise _validation_error(error) from None


def _validation_error(error: ValidationError) -> OpenAIError:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    loc = [str(part) for part in first["loc"]]
    if not loc:
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    if loc[0] == "prompt" and len(loc) > 1 and first["type"] != "missing":
        return bad_request("prompt must be a string, a list of strings, a list of token ids "
                           "or a list of lists of token ids", param="prompt")
    return bad_request(f"{'.'.join(loc)}: {first['msg']}", param=loc[0])


def check_model(requested: str | None, served_model_name: str) -> None:
    if requested is not None and requested != served_model_name:
        raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model",
                          code="model_not_found")


def to_sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                       logprobs_param: str,
                       structured_outputs: StructuredOutputsParams | None = None,
                       defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The request's SamplingParams; a bad value is a 400 naming its request field.

    A sampling field the request leaves out takes ``defaults`` (the model's generation
    config, ``ModelConfig.default_sampling_params``), then loom's own default."""
    defaults = defaults or {}

    def value(name: str, fallback: Any) -> Any:
        given = getattr(request, name)
        return given if given is not None else defaults.get(name, fallback)

    logit_bias = None
    if request.logit_bias:
        try:
            logit_bias = {int(token_id): bias for token_id, bias in request.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings)",
                              param="logit_bias") from None
    try:
        return SamplingParams(
            n=request.n,
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", 0),
            min_p=value("min_p", 0.0),
            seed=request.seed,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=value("repetition_penalty", 1.0),
            max_tokens=max_tokens, min_tokens=request.min_tokens,
            stop=request.stop or [], stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs, logit_bias=logit_bias,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured_outputs)
    except ValueError as error:
        message = str(error)
        match = _SAMPLING_PARAMS_FIELD.match(message)
        field = match.group(1) if match else None
        if field == "logprobs":
            field = logprobs_param
        if match:
            message = f"{field} {message[match.end():]}"
        raise bad_request(message, param=field) from None


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       prompt_param: str, default: int | None = None) -> int:
    """max_tokens, defaulting to what the context leaves (at most ``default``, the
    generation config's max_new_tokens); a 400 when it does not fit."""
    if requested is None:
        return min(max_model_len - num_prompt_tokens, default or max_model_len)
    if requested >= 1 and num_prompt_tokens + requested > max_model_len:
        raise OpenAIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{prompt_param}, {requested} in the completion). Please reduce the length of the "
            f"{prompt_param} or of max_tokens.", param=prompt_param, code="context_length_exceeded")
    return requested


def input_error(error: InvalidInputError, param: str) -> OpenAIError:
    return bad_request(str(error), param=param, code=error.code)


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN; vLLM reports -9999.0 for an impossible token."""
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def sorted_top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, most likely first."""
    top = [(token_id, lp) for token_id, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(top, key=lambda item: item[1].rank)[:k]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ----------------------------------------------------------------- streaming

def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_generators(generators: list[AsyncIterator[RequestOutput]]
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the generator, item) from several generators as items arrive.

    Closing the merged iterator (or an error in one generator) cancels them all, which
    aborts their requests.
    """
    if len(generators) == 1:
        async with contextlib.aclosing(generators[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(generator):
                async for item in generator:
                    queue.put_nowait((index, item))
        except Exception as error:  # noqa: BLE001 — re-raised by the consumer
            queue.put_nowait((index, error))
        queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """An event stream that stops (and so aborts its requests) the moment the client leaves.

    Starlette on ASGI 2.4 only notices a gone client when a send fails; here the body
    races ``http.disconnect``, and the body iterator is always closed.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        disconnect = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, disconnect):
                task.cancel()
            await asyncio.gather(stream, disconnect, return_exceptions=True)
            await self.body_iterator.aclose()


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a non-streaming handler; if the client leaves first, cancel it (aborting its
    requests) and answer nothing, as no one is listening."""
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (handler_task, disconnect_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(handler_task, disconnect_task, return_exceptions=True)
    if handler_task.cancelled():
        return Response(status_code=499)
    return handler_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

