"""``loom router``: one OpenAI-compatible front for several ``loom serve`` instances.

    client ── HTTP/SSE ──▶ router ── choose (backends.py: health + policy.py) ──▶ backend
                                  ── relay (proxy.py: the request, its answer) ──▶

Each generation request is routed by its prompt's text (prefix affinity over
characters: the router does not tokenize) and the backends' in-flight requests; the
body goes on unchanged, the answer comes back unchanged (an event stream event by
event). A backend that refuses the connection is marked down and the request goes to
another; one that breaks off mid-request fails that request (a 502 in OpenAI's
envelope, or an error event in a stream) and is marked down. Health checks bring it
back.

Routes: POST /v1/completions, /v1/chat/completions (routed), /tokenize, /detokenize
(least loaded); GET /v1/models (the union of the backends' models), /health and /ping
(200 with the backends listed while one is up, "degraded" if not all are; 503 when
none is), /metrics (the router's own), /version. The ``Authorization`` header goes to
the backend as it came: the backends check their keys.

Selection (``BackendPool.choose``) and relaying (``proxy.open_upstream``/``relay``) are
separate steps, so a front that pairs a prefill backend with a decode backend can
choose two and relay through both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import loom
from loom.entrypoints.listen import bind_listener
from loom.entrypoints.openai.responses import cancel_on_disconnect
from loom.router.backends import Backend, BackendPool
from loom.router.policy import PolicyConfig
from loom.router.proxy import (BackendBroke, BackendUnreachable, error_body, forwarded_headers,
                               open_upstream, relay)

logger = logging.getLogger("loom.router")


def prompt_keys(body: dict) -> str | list[int]:
    """What affinity hashes: the prompt's text (a completion's prompt, or a chat's
    messages as role and text in order), or its token ids when given as ids.

    # {"messages": [{"role": "system", "content": "Be brief."}, ...]} -> "system\\nBe brief.\\n..."
    """
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(part.get("text", "") for part in content
                                  if isinstance(part, dict))
            parts.append(f"{message.get('role', '')}\n{content or ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return prompt
        if isinstance(first, str):
            return "\n".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, list):
            return first
    return ""


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        labels = ["backend"]
        self.requests = Counter("loom:router_requests", "Requests routed, by backend and the "
                                "rule that chose it.", ["backend", "reason"],
                                registry=self.registry)
        self.failures = Counter("loom:router_backend_failures", "Requests that could not reach "
                                "their backend or broke off.", labels, registry=self.registry)
        up = Gauge("loom:router_backend_up", "1 while the backend passes its health checks.",
                   labels, registry=self.registry)
        in_flight = Gauge("loom:router_requests_in_flight", "Requests in flight per backend.",
                          labels, registry=self.registry)
        for backend in pool.backends:
            up.labels(backend.url).set_function(lambda b=backend: float(b.healthy))
            in_flight.labels(backend.url).set_function(lambda b=backend: pool.in_flight(b))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Router:
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.metrics = RouterMetrics(pool)
        self.created = int(time.time())

    # ----------------------------------------------------------------- generation

    async def generate(self, request: Request) -> Response:
        return await cancel_on_disconnect(request, self._generate(request))

    @staticmethod
    async def _json_body(request: Request) -> tuple[bytes, dict] | Response:
        """The request's body and its JSON object, or the 400 answer saying why not."""
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError as error:
            return _error(400, f"the body is not JSON: {error}", "invalid_request_error")
        if not isinstance(parsed, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        return body, parsed

    async def _generate(self, request: Request) -> Response:
        read = await self._json_body(request)
        if isinstance(read, Response):
            return read
        body, parsed = read
        keys = prompt_keys(parsed)
        return await self.forward(request, body, lambda exclude: self.pool.choose(
            keys, exclude=exclude))

    async def any_backend(self, request: Request) -> Response:
        body = await request.body()
        return await cancel_on_disconnect(request, self.forward(
            request, body, lambda exclude: self.pool.choose((), exclude=exclude)))

    async def forward(self, request: Request, body: bytes, choose) -> Response:
        """Choose a backend (``choose(exclude)``), send, relay. A backend that cannot be
        reached is marked down and the next one tried."""
        headers = forwarded_headers(request.headers)
        tried: list[Backend] = []
        while True:
            try:
                backend, ticket = choose(tried)
            except LookupError:
                return _no_backend(self.pool)
            self.metrics.requests.labels(backend.url, ticket.reason).inc()
            url = f"{backend.url}{request.url.path}"
            if request.url.query:
                url += f"?{request.url.query}"
            try:
                upstream = await open_upstream(self.pool.client, request.method, url, headers,
                                               body)
            except BackendUnreachable as error:
                self._failed(backend, str(error))
                self.pool.release(ticket)
                tried.append(backend)
                continue
            except BaseException as error:  # broke, or the client left (cancelled)
                self.pool.release(ticket)
                if isinstance(error, BackendBroke):
                    self._failed(backend, str(error))
                    return _error(502, f"the backend {backend.url} failed: {error}",
                                  "server_error", "backend_failed")
                raise
            break
        try:
            return await relay(upstream, backend.url, lambda: self.pool.release(ticket),
                               lambda reason: self._failed(backend, reason))
        except BackendBroke as error:
            return _error(502, f"the backend {backend.url} failed: {error}", "server_error",
                          "backend_failed")

    def _failed(self, backend: Backend, reason: str) -> None:
        self.metrics.failures.labels(backend.url).inc()
        self.pool.mark_down(backend, reason)

    # ----------------------------------------------------------------- the rest

    async def models(self, request: Request) -> Response:
        """The union of the healthy backends' models, by id."""
        healthy = self.pool.healthy
        if not healthy:
            return _no_backend(self.pool)
        headers = forwarded_headers(request.headers)

        async def fetch(backend: Backend):
            try:
                response = await self.pool.client.get(f"{backend.url}/v1/models",
                                                      headers=headers, timeout=10.0)
            except httpx.HTTPError:
                return None
            return response

        responses = await asyncio.gather(*(fetch(b) for b in healthy))
        models: dict[str, dict] = {}
        for response in responses:
            if response is None:
                continue
            if response.status_code != 200:  # e.g. 401: the backend's answer, as it is
                return Response(response.content, status_code=response.status_code,
                                media_type="application/json")
            for model in response.json().get("data", []):
                models.setdefault(model["id"], model)
        return JSONResponse({"object": "list", "data": list(models.values())})

    async def health(self, _: Request) -> Response:
        backends = self.pool.describe()
        num_up = sum(b["healthy"] for b in backends)
        status = "ok" if num_up == len(backends) else "degraded" if num_up else "unavailable"
        return JSONResponse({"status": status, "backends": backends},
                            status_code=200 if num_up else 503)

    async def metrics_route(self, _: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def version(self, _: Request) -> Response:
        return JSONResponse({"version": loom.__version__})


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def _no_backend(pool: BackendPool) -> JSONResponse:
    reasons = "; ".join(f"{b.url}: {b.last_error}" for b in pool.backends)
    return _error(503, f"no backend is available ({reasons})", "service_unavailable",
                  "service_unavailable")


def build_app(router: Router) -> Starlette:
    async def not_found(request: Request, _exc) -> Response:
        return _error(404, f"no route {request.method} {request.url.path}",
                      "invalid_request_error")

    async def not_allowed(request: Request, _exc) -> Response:
        return _error(405, f"no route {request.method} {request.url.path}",
                      "invalid_request_error")

    routes = [
        Route("/v1/completions", router.generate, methods=["POST"]),
        Route("/v1/chat/completions", router.generate, methods=["POST"]),
        Route("/tokenize", router.any_backend, methods=["POST"]),
        Route("/detokenize", router.any_backend, methods=["POST"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/health", router.health, methods=["GET"]),
        Route("/ping", router.health, methods=["GET", "POST"]),
        Route("/metrics", router.metrics_route, methods=["GET"]),
        Route("/version", router.version, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


# ----------------------------------------------------------------- `loom router`


def run_router(args: argparse.Namespace) -> int:
    if bool(args.prefill) != bool(args.decode) or bool(args.backend) == bool(args.prefill):
        raise ValueError("give --backend URL (each instance serves whole requests), or "
                         "--prefill URL with --decode URL (disaggregated pairs), not both")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request relayed
    policy_config = PolicyConfig(chunk_size=args.prefix_chunk_chars,
                                 min_match_ratio=args.min_match_ratio,
                                 balance_abs_threshold=args.balance_abs_threshold,
                                 balance_rel_threshold=args.balance_rel_threshold,
                                 affinity=args.routing_policy == "affinity")
    listener = bind_listener(args.host, args.port)
    try:
        return asyncio.run(_run(args, policy_config, listener))
    finally:
        listener.close()


async def _run(args: argparse.Namespace, policy_config: PolicyConfig,
               listener: socket.socket) -> int:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(connect=5.0, read=None, write=None, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        pools = [BackendPool(urls, client, policy_config, args.health_check_interval,
                             args.health_check_timeout)
                 for urls in ([args.prefill, args.decode] if args.prefill else [args.backend])]
        await asyncio.gather(*(pool.start() for pool in pools))
        checks = [asyncio.create_task(pool.run_health_checks(), name="loom-router-health")
                  for pool in pools]
        if args.prefill:
            from loom.router.disaggregated import DisaggregatedRouter

            router = DisaggregatedRouter(*pools)
        else:
            router = Router(pools[0])
        server = uvicorn.Server(uvicorn.Config(build_app(router),
                                               log_level=args.uvicorn_log_level,
                                               access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=5))
        host, port = listener.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        backends = [b for p in pools for b in p.backends]
        up = ", ".join(b.url for p in pools for b in p.healthy) or "none yet"
        print(f"loom router: ready on http://{host}:{port} for {len(backends)} "
              f"backends{' (prefill/decode pairs)' if args.prefill else ''} (up: {up})",
              flush=True)
        try:
            await server.serve(sockets=[listener])
        finally:
            for task in checks:
                task.cancel()
            for task in checks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return 0

