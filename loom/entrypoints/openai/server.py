"""The OpenAI-compatible HTTP server: routes, guards, and the life cycle of ``loom serve``.

Life cycle:

    bind the socket (fail fast on a busy port) -> start the engine core process and
    wait until it has loaded the model -> serve, printing "ready on http://HOST:PORT"
    -> SIGTERM: drain (new requests get 503) for up to --shutdown-timeout, abort what
    is left, exit 0 | engine core died: fail requests in flight, /health 503, exit 1

Every route but /health needs the API key when --api-key is given. Errors are
OpenAI's ``{"error": {"message", "type", "param", "code"}}``, never a bare 500.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import sys
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import loom
from loom.async_llm import AsyncLLM
from loom.config import EngineConfig
from loom.entrypoints.openai.protocol import error_body
from loom.entrypoints.openai.serving_chat import OpenAIServingChat
from loom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from loom.entrypoints.openai.serving_engine import OpenAIError, cancel_on_disconnect
from loom.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

logger = logging.getLogger("loom.serve")

# After the engine died, keep answering (503) this long so clients and probes see
# why, then exit 1.
_DEAD_ENGINE_EXIT_DELAY_S = 1.0
_UNGUARDED_PATHS = ("/health",)


class ServerState:
    """What the routes and guards consult: the engine, the key, draining, the exit code."""

    def __init__(self, engine: AsyncLLM, served_model_name: str, api_key: str | None,
                 shutdown_timeout: float) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.created = int(time.time())
        # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
        self.chat_options: dict[str, Any] = {}

    @property
    def healthy(self) -> bool:
        return not self.draining and not self.engine.is_dead

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests, let those in flight finish, then stop."""
        if self.draining:
            logger.warning("second SIGTERM: stopping now")
            self._stop()
            return
        self.draining = True
        logger.info("SIGTERM: draining %d requests in flight for up to %.0f s",
                    self.engine.num_requests_in_flight, self.shutdown_timeout)
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.engine.wait_until_idle(), self.shutdown_timeout)
        if self.engine.num_requests_in_flight:
            logger.warning("aborting %d requests still in flight after %.0f s",
                           self.engine.num_requests_in_flight, self.shutdown_timeout)
            self.engine.abort_all("the server is shutting down")
        self._stop()

    def engine_died(self) -> None:
        self.exit_code = 1
        asyncio.get_running_loop().call_later(_DEAD_ENGINE_EXIT_DELAY_S, self._stop)

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class GuardMiddleware:
    """API key on every route but /health; 503 while draining or after the engine died."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self._expected = f"Bearer {state.api_key}".encode() if state.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = JSONResponse(error_body(
                    "invalid or missing API key; send 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        if not self.state.healthy and scope["path"] != "/metrics":
            reason = ("the server is shutting down" if self.state.draining
                      else f"the engine is dead: {self.state.engine.dead_error}")
            response = JSONResponse(error_body(reason, "service_unavailable",
                                               code="service_unavailable"),
                                    status_code=503, headers={"Retry-After": "1"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    engine = state.engine
    completion = OpenAIServingCompletion(engine, state.served_model_name)
    chat = OpenAIServingChat(engine, state.served_model_name, **state.chat_options)
    app = FastAPI(title="loom", version=loom.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> Response:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        message = (f"no route {request.method} {request.url.path}"
                   if error.status_code in (404, 405) else str(error.detail))
        return JSONResponse(error_body(message, "invalid_request_error"),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}",
                                       "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return Response(status_code=200)
        reason = "draining" if state.draining else f"engine dead: {engine.dead_error}"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": loom.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "loom", "root": engine.config.model.model,
            "max_model_len": engine.config.model.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.body()
        return await cancel_on_disconnect(request, completion.create(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await request.body()
        return await cancel_on_disconnect(request, chat.create(body))

    return app


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM meaning "drain" and no re-raising of signals at the end."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.state.begin_drain)
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            loop.remove_signal_handler(signal.SIGINT)

    def _interrupt(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def serve(args: argparse.Namespace) -> int:
    """``loom serve``; returns the exit code."""
    from loom.cli import engine_kwargs
    from loom.default_model import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = args.model or default_model_path()
    kwargs = engine_kwargs(args)
    # The server runs its workers in their own processes unless told otherwise.
    kwargs["distributed_executor_backend"] = kwargs.get("distributed_executor_backend") or "mp"
    config = EngineConfig.from_args(model, **kwargs, served_model_name=args.served_model_name)
    listener = _bind(args.host, args.port)
    try:
        return asyncio.run(_serve(args, config, listener))
    finally:
        listener.close()


async def _serve(args: argparse.Namespace, config: EngineConfig, listener: socket.socket) -> int:
    host, port = listener.getsockname()[:2]
    print(f"loom serve: loading {config.model.model} ...", flush=True)
    started = time.perf_counter()
    engine = AsyncLLM(config, max_num_waiting=args.max_num_waiting,
                      log_requests=not args.disable_log_requests)
    try:
        num_blocks = await engine.start()
    except RuntimeError as error:
        print(f"loom serve: error: {error}", file=sys.stderr, flush=True)
        await engine.shutdown()
        return 1
    print(f"loom serve: loaded in {time.perf_counter() - started:.1f} s; KV cache of "
          f"{num_blocks} blocks of {config.cache.block_size} tokens", flush=True)
    state = ServerState(engine, config.model.name, args.api_key, args.shutdown_timeout)
    state.chat_options = {"enable_auto_tool_choice": args.enable_auto_tool_choice,
                          "tool_call_parser": args.tool_call_parser,
                          "reasoning_parser": args.reasoning_parser}
    engine.on_dead.append(state.engine_died)
    server = _Server(uvicorn.Config(build_app(state), log_level=args.uvicorn_log_level,
                                    access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5), state)
    state.server = server
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"loom serve: ready on http://{_url_host(host)}:{port}", flush=True)
    try:
        await serving
    finally:
        await engine.shutdown()
    if state.exit_code:
        print(f"loom serve: exiting after engine failure: {engine.dead_error}", file=sys.stderr,
              flush=True)
    return state.exit_code


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets that do, and without
    # it every response waits ~40 ms for a delayed ACK (Nagle).
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}; pick another "
                         "--port or --host") from None
    listener.listen(2048)
    listener.set_inheritable(False)
    return listener


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
