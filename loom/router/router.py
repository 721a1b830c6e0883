"""``Router``: a pool of ``loom serve`` backends behind one front (server.py builds the
app on it). A generation request goes to the backend its prompt's keys and the
backends' loads choose (``prompt_keys``, ``BackendPool.choose``), and is relayed there
(proxy.py); ``DisaggregatedRouter`` (disaggregated.py) adds a prefill hop."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import loom
from loom.entrypoints.openai.responses import cancel_on_disconnect
from loom.router.backends import Backend, BackendPool
from loom.router.proxy import (BackendBroke, BackendUnreachable, error_response,
                               forwarded_headers, open_upstream, relay)


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
            return error_response(400, f"the body is not JSON: {error}",
                                  "invalid_request_error")
        if not isinstance(parsed, dict):
            return error_response(400, "the body must be a JSON object",
                                  "invalid_request_error")
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
                return no_backend_response(self.pool)
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
                    return error_response(502, f"the backend {backend.url} failed: {error}",
                                          "server_error", "backend_failed")
                raise
            break
        try:
            return await relay(upstream, backend.url, lambda: self.pool.release(ticket),
                               lambda reason: self._failed(backend, reason))
        except BackendBroke as error:
            return error_response(502, f"the backend {backend.url} failed: {error}",
                                  "server_error", "backend_failed")

    def _failed(self, backend: Backend, reason: str) -> None:
        self.metrics.failures.labels(backend.url).inc()
        self.pool.mark_down(backend, reason)

    # ----------------------------------------------------------------- the rest

    async def models(self, request: Request) -> Response:
        """The union of the healthy backends' models, by id."""
        healthy = self.pool.healthy
        if not healthy:
            return no_backend_response(self.pool)
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


def no_backend_response(pool: BackendPool) -> JSONResponse:
    """The 503 for a pool with no backend up, each backend's last error named."""
    reasons = "; ".join(f"{b.url}: {b.last_error}" for b in pool.backends)
    return error_response(503, f"no backend is available ({reasons})", "service_unavailable",
                          "service_unavailable")
