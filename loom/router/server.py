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
import logging
import socket

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loom.entrypoints.listen import bind_listener
from loom.router.backends import BackendPool
from loom.router.disaggregated import DisaggregatedRouter
from loom.router.policy import PolicyConfig
from loom.router.proxy import error_response
from loom.router.router import Router

logger = logging.getLogger("loom.router")


def build_app(router: Router) -> Starlette:
    async def not_found(request: Request, _exc) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}",
                              "invalid_request_error")

    async def not_allowed(request: Request, _exc) -> Response:
        return error_response(405, f"no route {request.method} {request.url.path}",
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


def router_policy(args: argparse.Namespace) -> PolicyConfig:
    """``loom router``'s checks before it listens: the backends' flags, the policy."""
    if bool(args.prefill) != bool(args.decode) or bool(args.backend) == bool(args.prefill):
        raise ValueError("give --backend URL (each instance serves whole requests), or "
                         "--prefill URL with --decode URL (disaggregated pairs), not both")
    return PolicyConfig(chunk_size=args.prefix_chunk_chars,
                        min_match_ratio=args.min_match_ratio,
                        balance_abs_threshold=args.balance_abs_threshold,
                        balance_rel_threshold=args.balance_rel_threshold,
                        affinity=args.routing_policy == "affinity")


def run_router(args: argparse.Namespace) -> int:
    policy_config = router_policy(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request relayed
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
        router = DisaggregatedRouter(*pools) if args.prefill else Router(pools[0])
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

