"""The two ways a generation route answers, both ending the moment the client leaves:

    stream: true    SSEResponse over an async generator of ``sse(...)`` events, then
                    SSE_DONE; however it ends (the client leaving too, even before the
                    first event), it closes the generator and calls ``abort``
    stream: false   cancel_on_disconnect(handler): the client leaving cancels the
                    handler, whose awaited RequestStream aborts its request
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that stops (and so aborts its requests) the moment the client leaves.

    Starlette on ASGI 2.4 only notices a gone client when a send fails; here the body
    races ``http.disconnect``, the body iterator is always closed and ``abort`` always
    called (it must be a no-op for requests that finished).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], abort: Callable[[], None]) -> None:
        super().__init__(events)
        self.abort = abort

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
            self.abort()


async def sse_payloads(chunks: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a route's own SSE events (``sse``), ``[DONE]`` left out: what
    the APIs over the chat route (Messages, Responses) translate, chunk by chunk."""
    async for text in chunks:
        data = text.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            yield json.loads(data)


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a route's handler; if the client leaves first, cancel it (aborting its
    requests) and answer nothing, as no one is listening. A handler that returns an
    SSEResponse returns at once; the stream then watches the client itself."""
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
