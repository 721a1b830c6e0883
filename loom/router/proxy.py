"""Moving one request to a chosen backend and its answer back; no choosing here.

``open_upstream`` sends the request and waits for the response head; ``relay`` turns
the upstream response into the client's: a JSON answer is read whole and passed on
with its status; an event stream (``text/event-stream``) is passed on event by event
as it arrives (nothing is held back but an incomplete event), so tokens reach the
client when the backend sends them.

Failures:
  - the backend cannot be reached (connection refused, connect timeout): the request
    never arrived, ``BackendUnreachable``; the caller may try another backend;
  - the connection breaks before the response head (the backend died while working
    on it): ``BackendBroke``, the caller answers 502;
  - it breaks mid-stream: the client gets an error event in OpenAI's envelope, then
    ``data: [DONE]``, and ``on_broken`` runs (the pool marks the backend down).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

# Hop-by-hop headers and those the router recomputes, never forwarded.
_DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                    "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection",
                    "accept-encoding"}
_PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id")
BACKEND_HEADER = "x-loom-backend"  # which backend answered, on every relayed response


class BackendUnreachable(Exception):
    """The request did not reach the backend; it is safe to send it elsewhere."""


class BackendBroke(Exception):
    """The backend took the request and went away before answering."""


def error_body(message: str, type_: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def error_response(status: int, message: str, type_: str,
                   code: str | None = None) -> JSONResponse:
    """The router's own answer in OpenAI's error envelope; a 503 says when to retry."""
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def forwarded_headers(headers) -> dict[str, str]:
    return {name: value for name, value in headers.items()
            if name.lower() not in _DROPPED_HEADERS}


async def open_upstream(client: httpx.AsyncClient, method: str, url: str,
                        headers: dict[str, str], body: bytes) -> httpx.Response:
    """Send the request; returns once the response head arrived (the body unread)."""
    request = client.build_request(method, url, headers=headers, content=body)
    try:
        return await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as error:
        raise BackendUnreachable(f"{type(error).__name__}: {error}") from error
    except httpx.HTTPError as error:
        raise BackendBroke(f"{type(error).__name__}: {error}") from error


async def relay(upstream: httpx.Response, backend_url: str,
                on_done: Callable[[], None], on_broken: Callable[[str], None]) -> Response:
    """The client's response for ``upstream``; ``on_done`` runs exactly once when it has
    been passed on or abandoned (the client left), ``on_broken`` when the backend broke
    off mid-body."""
    headers = {name: upstream.headers[name] for name in _PASSED_RESPONSE_HEADERS
               if name in upstream.headers}
    headers[BACKEND_HEADER] = backend_url
    if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            body = await upstream.aread()
        except httpx.HTTPError as error:
            on_broken(f"{type(error).__name__}: {error}")
            raise BackendBroke(f"{type(error).__name__}: {error}") from error
        finally:
            await upstream.aclose()
            on_done()
        return Response(body, status_code=upstream.status_code, headers=headers)
    return _RelayedStream(upstream, on_done, _events(upstream, backend_url, on_broken),
                          status_code=upstream.status_code, headers=headers)


class _RelayedStream(StreamingResponse):
    """An event stream passed on until it ends or the client leaves (raced as in
    ``responses.SSEResponse``); however it ends, even before the first event, the
    upstream response is closed (the backend sees the disconnect and aborts its
    request) and ``on_done`` runs once."""

    def __init__(self, upstream: httpx.Response, on_done: Callable[[], None],
                 *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._upstream = upstream
        self._on_done = on_done

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        disconnect = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, disconnect):
                task.cancel()
            await asyncio.gather(stream, disconnect, return_exceptions=True)
            self._on_done()
            await self.body_iterator.aclose()
            await self._upstream.aclose()


async def _events(upstream: httpx.Response, backend_url: str,
                  on_broken: Callable[[str], None]) -> AsyncIterator[bytes]:
    """Complete SSE events as they arrive; an incomplete tail waits for its end."""
    pending = b""
    try:
        async for data in upstream.aiter_raw():
            pending += data
            end = pending.rfind(b"\n\n")
            if end >= 0:
                yield pending[:end + 2]
                pending = pending[end + 2:]
        if pending:
            yield pending
    except httpx.HTTPError as error:
        reason = f"{type(error).__name__}: {error}"
        on_broken(reason)
        message = f"the backend {backend_url} failed while streaming: {reason}"
        yield f"data: {json.dumps(error_body(message, 'server_error', 'backend_failed'))}\n\n".encode()
        yield b"data: [DONE]\n\n"
