"""The OpenAI-compatible HTTP server: routes, guards, and the life cycle of ``loom serve``.

Life cycle:

    bind the socket (fail fast on a busy port) -> serve at once, every route answering
    503 {"status": "loading"} -> start the engine core process and wait until it has
    loaded the model -> the real routes, printing "ready on http://HOST:PORT"
    -> SIGTERM: drain (new requests get 503) for up to --shutdown-timeout, abort what
    is left, exit 0 | engine core died: fail requests in flight, /health 503, exit 1

Every route but /health, /ping, the API docs (/docs, /openapi.json) and the chat page
(/, web_ui.py) needs the API key when --api-key is given; CORS preflights are answered
before the key is asked for.
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``, never a bare 500.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import loom
from loom.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestAbortedError
from loom.config import EngineConfig
from loom.dp_async_llm import DPAsyncLLM
from loom.engine_args import EngineArgs
from loom.entrypoints.anthropic_messages import count_tokens, create_message
from loom.entrypoints.anthropic_messages import error_response as messages_error_response
from loom.entrypoints.listen import bind_listener
from loom.entrypoints.openai.cli_args import ssl_config
from loom.entrypoints.openai.control_routes import add_control_routes
from loom.entrypoints.openai.errors import OpenAIError, error_body
from loom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from loom.entrypoints.openai.responses import cancel_on_disconnect
from loom.entrypoints.openai.serving_chat import OpenAIServingChat
from loom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from loom.entrypoints.openai.serving_pooling import (ClassificationRequest, EmbeddingRequest,
                                                    OpenAIServingPooling, RerankRequest,
                                                    ScoreRequest)
from loom.entrypoints.openai.serving_tokenize import (DetokenizeRequest, DetokenizeResponse,
                                                      OpenAIServingTokenization,
                                                      TokenizeChatRequest,
                                                      TokenizeCompletionRequest,
                                                      TokenizeResponse)
from loom.entrypoints.openai.web_ui import add_web_ui, chat_page
from loom.entrypoints.openai_responses import OpenAIResponses
from loom.envs import settings
from loom.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from loom.input_processor import InvalidInputError
from loom.sampling_params import PoolingParams, SamplingParams
from loom.stats_logger import LoggingStatLogger

logger = logging.getLogger("loom.serve")

# After the engine died, keep answering (503) this long so clients and probes see
# why, then exit 1.
_DEAD_ENGINE_EXIT_DELAY_S = 1.0
_HEALTH_GENERATE_TIMEOUT_S = 30.0
_UNGUARDED_PATHS = ("/", "/health", "/health_generate", "/ping", "/docs", "/docs/oauth2-redirect", "/openapi.json")


@dataclass(frozen=True)
class HttpOptions:
    """CORS: which browser pages may call the API."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        return cls(tuple(args.allowed_origins), tuple(args.allowed_methods),
                   tuple(args.allowed_headers), args.allow_credentials)




class ServerState:
    """What the routes and guards consult: the engine, the key, draining, the exit code."""

    def __init__(self, engine: AsyncLLM | None, served_model_name: str, api_key: str | None,
                 shutdown_timeout: float) -> None:
        self.engine = engine  # None until the model has loaded
        self.served_model_name = served_model_name
        self.api_key = api_key
        # --enable-control-endpoints: control_routes.py, and what a path-less update reads
        self.control_endpoints = False
        self.default_weights_path: str | None = None
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.created = int(time.time())
        # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
        self.chat_options: dict[str, Any] = {}
        self.http_options = HttpOptions()
        self.web_ui = True  # the chat page at GET / (--disable-web-ui)

    @property
    def healthy(self) -> bool:
        return self.engine is not None and not self.draining and not self.engine.is_dead

    def begin_drain(self) -> None:
        """SIGTERM (or Ctrl-C): refuse new requests, let those in flight finish, then stop."""
        if self.engine is None:  # still loading: nothing to drain
            logger.info("stopping while the model loads")
            self._stop()
            return
        if self.draining:
            logger.warning("second SIGTERM: stopping now")
            self._stop()
            return
        self.draining = True
        logger.info("draining %d requests in flight for up to %.0f s",
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
        # Anthropic's clients send the key as x-api-key
        self._expected_key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        if path in _UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._expected is not None:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if not (hmac.compare_digest(given, self._expected) or hmac.compare_digest(
                    headers.get(b"x-api-key", b""), self._expected_key)):
                message = "invalid or missing API key; send 'Authorization: Bearer <key>'"
                response = (messages_error_response(401, message + " or 'x-api-key: <key>'")
                            if path.startswith("/v1/messages") else
                            JSONResponse(error_body(message, "authentication_error",
                                                    code="invalid_api_key"), status_code=401))
                await response(scope, receive, send)
                return
        if not self.state.healthy and path != "/metrics":
            reason = ("the server is shutting down" if self.state.draining
                      else f"the engine is dead: {self.state.engine.dead_error}")
            response = (messages_error_response(503, reason)
                        if path.startswith("/v1/messages") else
                        JSONResponse(error_body(reason, "service_unavailable",
                                                code="service_unavailable"), status_code=503))
            response.headers["Retry-After"] = "1"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _route_path(scope) -> str:
    """The path the routes see: without the --root-path prefix if a proxy left it on
    (Starlette's routing strips it the same way)."""
    path, root_path = scope["path"], scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        return path[len(root_path):]
    return path


def _json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its raw body itself (so that a bad
    body is a 400 in OpenAI's envelope, not FastAPI's 422)."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# Request bodies declared with _json_body, added to the schema's components.
_BODY_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                TokenizeChatRequest, DetokenizeRequest, EmbeddingRequest, RerankRequest,
                ScoreRequest, ClassificationRequest)


def _install_openapi(app: FastAPI, bearer_auth: bool) -> None:
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            _, definitions = models_json_schema(
                [(model, "validation") for model in _BODY_MODELS],
                ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(definitions["$defs"])
            if bearer_auth:
                components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"apiKey": []}]
        return app.openapi_schema

    app.openapi = openapi


def build_app(state: ServerState) -> FastAPI:
    engine = state.engine
    options = state.http_options
    completion = OpenAIServingCompletion(engine, state.served_model_name)
    chat = OpenAIServingChat(engine, state.served_model_name, **state.chat_options)
    tokenization = OpenAIServingTokenization(engine, state.served_model_name)
    pooling = OpenAIServingPooling(engine, state.served_model_name)
    responses_api = OpenAIResponses(chat)
    app = FastAPI(title="loom", version=loom.__version__, redoc_url=None)
    _install_openapi(app, bearer_auth=state.api_key is not None)
    app.add_middleware(GuardMiddleware, state=state)
    # Added last, so outermost: CORS preflights (OPTIONS with Access-Control-Request-Method,
    # never carrying credentials) are answered here without meeting the guard, and every
    # response, a 401 too, gets its CORS headers.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> Response:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        message = (f"no route {request.method} {request.url.path}"
                   if error.status_code in (404, 405) else str(error.detail))
        if _route_path(request.scope).startswith("/v1/messages"):  # Anthropic's shape
            return messages_error_response(error.status_code, message)
        return JSONResponse(error_body(message, "invalid_request_error"),
                            status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(_: Request, error: RequestValidationError) -> Response:
        """A bad query parameter (routes with bodies parse them themselves): a 400 in
        OpenAI's envelope, not FastAPI's 422 {"detail": ...}."""
        first = error.errors()[0]
        name = ".".join(str(part) for part in first["loc"][1:]) or None
        return JSONResponse(error_body(f"{name}: {first['msg']}", "invalid_request_error",
                                       param=name), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        message = f"internal error: {type(error).__name__}: {error}"
        if _route_path(request.scope).startswith("/v1/messages"):
            return messages_error_response(500, message)
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    if state.control_endpoints:
        add_control_routes(app, engine, state.default_weights_path)

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return Response(status_code=200)
        reason = "draining" if state.draining else f"engine dead: {engine.dead_error}"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/health_generate")
    async def health_generate(timeout: float = Query(_HEALTH_GENERATE_TIMEOUT_S, gt=0,
                                                     allow_inf_nan=False)) -> Response:
        """The deep probe: one greedy token through the whole path (tokens to the engine
        core, a step on every worker, the output back), within ``timeout`` seconds."""
        if not state.healthy:
            return await health()
        started = time.perf_counter()
        token_ids = engine.tokenizer.encode("ping") or [0]
        task = engine.config.model.task
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                pooling=None if task == "generate" else PoolingParams(task=task))
        try:
            engine.input_processor.validate_params(params)  # a score's yes/no token ids
            stream = engine.add_request(f"health-{uuid.uuid4().hex}", None, token_ids, params,
                                        stream=False)
        except (EngineDeadError, QueueFullError, InvalidInputError) as error:
            return JSONResponse({"status": str(error)}, status_code=503)
        try:
            async with asyncio.timeout(timeout):
                async for _ in stream:
                    pass
        except TimeoutError:
            stream.abort()
            return JSONResponse({"status": f"no token within {timeout:g}s"}, status_code=503)
        except (EngineDeadError, RequestAbortedError) as error:
            return JSONResponse({"status": str(error)}, status_code=503)
        return JSONResponse({"status": "ok", "latency_s": round(time.perf_counter() - started, 4)})

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health probe, as vLLM answers it: the same as /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": loom.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": state.served_model_name, "object": "model", "created": state.created,
                "owned_by": "loom", "root": engine.config.model.model,
                "max_model_len": engine.config.model.max_model_len}
        adapters = [{**base, "id": name, "root": path, "parent": state.served_model_name}
                    for name, path in engine.config.model.lora_modules]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await request.body()
        return await cancel_on_disconnect(request, completion.create(body))

    @app.post("/v1/embeddings", openapi_extra=_json_body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        """--task embed (loom/entrypoints/openai/serving_pooling.py)."""
        return await cancel_on_disconnect(request, pooling.embeddings(await request.body()))

    @app.post("/v1/rerank", openapi_extra=_json_body(RerankRequest))
    @app.post("/v2/rerank", openapi_extra=_json_body(RerankRequest))
    @app.post("/rerank", openapi_extra=_json_body(RerankRequest))
    async def rerank(request: Request) -> Response:
        """--task score: Jina's and Cohere's rerank."""
        return await cancel_on_disconnect(request, pooling.rerank(await request.body()))

    @app.post("/classify", openapi_extra=_json_body(ClassificationRequest))
    @app.post("/v1/classify", openapi_extra=_json_body(ClassificationRequest))
    async def classify(request: Request) -> Response:
        """--task classify: vLLM's classify."""
        return await cancel_on_disconnect(request, pooling.classify(await request.body()))

    @app.post("/score", openapi_extra=_json_body(ScoreRequest))
    @app.post("/v1/score", openapi_extra=_json_body(ScoreRequest))
    async def score(request: Request) -> Response:
        """--task score: vLLM's score."""
        return await cancel_on_disconnect(request, pooling.score(await request.body()))

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await request.body()
        return await cancel_on_disconnect(request, chat.create(body))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API over the chat route (loom/entrypoints/anthropic_messages.py)."""
        body = await request.body()
        return await cancel_on_disconnect(request, create_message(chat, body))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(chat, await request.body())

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API over the chat route (loom/entrypoints/openai_responses.py).
        Stored responses stay in this process's memory, the last 1024, oldest evicted first."""
        body = await request.body()
        return await cancel_on_disconnect(request, responses_api.create(body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> Response:
        return responses_api.retrieve(response_id, stream)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses_api.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        """loom runs no background responses: a stored one is a 400, an unknown one a 404."""
        return responses_api.cancel(response_id)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}},
              openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(request: Request) -> Response:
        return await tokenization.tokenize(await request.body())

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}},
              openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return tokenization.detokenize(await request.body())

    if state.web_ui:
        add_web_ui(app)
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
        """Ctrl-C drains as SIGTERM does; a second one stops at once."""
        if self.state.draining or self.state.engine is None:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.state.begin_drain()


class _LoadingSwitch:
    """The ASGI app uvicorn serves from the moment the port is bound: until the model
    has loaded, 503 on every route ({"status": "loading"} on the health probes) but the
    chat page (which retries until loaded), then the real app."""

    def __init__(self, web_ui: bool = False) -> None:
        self.app = None
        self.web_ui = web_ui

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if self.web_ui and _route_path(scope) == "/" and scope["method"] in ("GET", "HEAD"):
            await chat_page().response()(scope, receive, send)
            return
        if _route_path(scope) in ("/health", "/health_generate", "/ping"):
            body = {"status": "loading"}
        else:
            body = error_body("the model is still loading; retry when /health answers 200",
                              "service_unavailable", code="service_unavailable")
        response = JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        await response(scope, receive, send)


def serve(args: argparse.Namespace) -> int:
    """``loom serve``; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = serve_config(args)
    if args.headless:
        from loom.entrypoints.headless import run_headless

        return run_headless(config)
    listener = bind_listener(args.host, args.port)
    try:
        return asyncio.run(_serve(args, config, listener))
    finally:
        listener.close()


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config ``loom serve`` runs with; every check that needs no weights and
    no process is done on the way (TLS files, data-parallel flags, the checkpoint)."""
    from loom.default_model import default_model_path

    ssl_config(args)  # a bad combination of TLS flags fails before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    engine_args = dataclasses.replace(
        engine_args, model=args.model or default_model_path(),
        # The server runs its workers in their own processes unless told otherwise.
        distributed_executor_backend=engine_args.distributed_executor_backend or "mp",
        **data_parallel_kwargs(args))
    return engine_args.create_engine_config()


def data_parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The data-parallel flags, checked together (a ValueError naming the flag)."""
    size, local, start = (args.data_parallel_size, args.data_parallel_size_local,
                          args.data_parallel_start_rank)
    if local is not None and local > size:
        raise ValueError(f"--data-parallel-size-local {local} is more than "
                         f"--data-parallel-size {size}")
    if args.headless:
        if args.data_parallel_address is None:
            raise ValueError("--headless needs --data-parallel-address: the head host's "
                             "address, where its loom serve listens for this host")
        if size < 2:
            raise ValueError("--headless runs some of several data-parallel replicas; give "
                             "--data-parallel-size >= 2 (the head's)")
        if not 1 <= start < size:
            raise ValueError(f"--data-parallel-start-rank {start} is out of range for "
                             f"--headless: the head runs rank 0, so give 1..{size - 1}")
        if local == 0:
            raise ValueError("--headless with --data-parallel-size-local 0 would run nothing")
        local = size - start if local is None else local
        if start + local > size:
            raise ValueError(f"--data-parallel-start-rank {start} + --data-parallel-size-local "
                             f"{local} runs ranks past the last, {size - 1}")
    elif start != 0:
        raise ValueError("--data-parallel-start-rank is for --headless hosts; the head (the "
                         "host serving the API) runs ranks 0 .. --data-parallel-size-local - 1")
    return {"data_parallel_size": size, "data_parallel_size_local": local,
            "data_parallel_start_rank": start,
            "data_parallel_address": args.data_parallel_address or "127.0.0.1",
            "data_parallel_rpc_port": args.data_parallel_rpc_port}


async def _serve(args: argparse.Namespace, config: EngineConfig, listener: socket.socket) -> int:
    host, port = listener.getsockname()[:2]
    url = f"{'https' if args.ssl_certfile else 'http'}://{_url_host(host)}:{port}"
    state = ServerState(None, config.model.name, args.api_key, args.shutdown_timeout)
    state.chat_options = {"enable_auto_tool_choice": args.enable_auto_tool_choice,
                          "tool_call_parser": args.tool_call_parser,
                          "reasoning_parser": args.reasoning_parser}
    state.http_options = HttpOptions.from_args(args)
    state.web_ui = not args.disable_web_ui
    switch = _LoadingSwitch(web_ui=state.web_ui)
    server = _Server(uvicorn.Config(switch, log_level=args.uvicorn_log_level,
                                    access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5, root_path=args.root_path,
                                    **ssl_config(args)), state)
    state.server = server
    state.control_endpoints = args.enable_control_endpoints or args.dynamic_load_weight
    if args.load_strategy == "ipc":  # the trainer's manifest beside the checkpoint
        state.default_weights_path = config.model.model
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    print(f"loom serve: listening on {url} (503 until loaded); loading {config.model.model} ...",
          flush=True)
    started = time.perf_counter()
    loading = asyncio.create_task(_start_engine(args, config, state))
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # stopped (SIGINT, SIGTERM) while loading
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
        await serving
        return 130
    try:
        num_blocks = loading.result()
    except RuntimeError as error:
        print(f"loom serve: error: {error}", file=sys.stderr, flush=True)
        server.should_exit = True
        await serving
        return 1
    engine = state.engine
    replicas = config.parallel.data_parallel_size
    print(f"loom serve: loaded in {time.perf_counter() - started:.1f} s; KV cache of "
          f"{num_blocks} blocks of {config.cache.block_size} tokens"
          + (f" in each of {replicas} data-parallel replicas" if replicas > 1 else ""),
          flush=True)
    engine.on_dead.append(state.engine_died)
    stats = None if args.disable_log_stats else asyncio.gather(*(
        LoggingStatLogger(metrics, config.model.name, settings().log_stats_interval_s,
                          prefix=f"replica {rank}: " if replicas > 1 else "").run()
        for rank, metrics in enumerate(engine.replica_metrics)))
    switch.app = build_app(state)
    if not serving.done():
        print(f"loom serve: ready on {url}", flush=True)
    try:
        await serving
    finally:
        if stats is not None:
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats
        await engine.shutdown()
    if state.exit_code:
        print(f"loom serve: exiting after engine failure: {engine.dead_error}", file=sys.stderr,
              flush=True)
    return state.exit_code


async def _start_engine(args: argparse.Namespace, config: EngineConfig,
                        state: ServerState) -> int:
    """Build the engine (the tokenizer loads in a thread, so the port answers meanwhile)
    and start its core; returns its KV blocks. Cancelled: stops what was started."""
    loop = asyncio.get_running_loop()
    engine_class = DPAsyncLLM if config.parallel.data_parallel_size > 1 else AsyncLLM
    options = ({"affinity": args.routing_policy == "affinity"}
               if engine_class is DPAsyncLLM else {})
    engine = await loop.run_in_executor(None, lambda: engine_class(
        config, max_num_waiting=args.max_num_waiting, log_requests=args.enable_log_requests,
        **options))
    try:
        # A multimodal model's image processor (seconds of imports) loads in a thread while
        # the core loads the model, not on the event loop at the first image.
        image_processor = loop.run_in_executor(None, lambda: engine.input_processor.mm_processor)
        num_blocks = await engine.start()
        await image_processor
    except BaseException:
        await engine.shutdown(timeout=2.0)
        raise
    state.engine = engine
    return num_blocks


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
