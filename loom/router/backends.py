"""BackendPool: the ``loom serve`` instances behind ``loom router``, their health, the choice.

Selection only; moving bytes is ``proxy.py``'s. A backend is *up* while its ``/health``
answers 200; it is taken out of the choice (``RoutingPolicy.set_available``) when a
health check fails (refused, timed out, any status but 200: a server that is loading,
draining or whose engine died answers 503) or when a request to it cannot connect or
breaks off, and taken back at the first check that succeeds. A backend taken out
forgets its prefix affinity (it may have restarted with an empty cache).

    start(): one round of checks (the router's /health is true from the first answer)
    run_health_checks(): a round every ``check_interval_s``, each check bounded by
                         ``check_timeout_s``, all backends concurrently
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from loom.router.policy import PolicyConfig, RoutingPolicy, Ticket

logger = logging.getLogger("loom.router")


@dataclass
class Backend:
    url: str  # e.g. http://10.0.0.5:8000, no trailing slash
    index: int
    healthy: bool = False
    last_error: str | None = "not checked yet"
    last_check: float | None = None  # time.time() of the last health check
    requests_total: int = 0  # requests routed to it
    failures_total: int = 0  # requests that could not reach it or broke off


class BackendPool:
    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient,
                 policy_config: PolicyConfig | None = None, check_interval_s: float = 2.0,
                 check_timeout_s: float = 2.0) -> None:
        if not urls:
            raise ValueError("give at least one --backend URL")
        normalized = [normalize_url(url) for url in urls]
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"a --backend is given twice: {', '.join(urls)}")
        if check_interval_s <= 0 or check_timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")
        self.backends = [Backend(url, index) for index, url in enumerate(normalized)]
        self.policy = RoutingPolicy(len(self.backends), policy_config)
        for backend in self.backends:
            self.policy.set_available(backend.index, False)
        self.client = client
        self.check_interval_s = check_interval_s
        self.check_timeout_s = check_timeout_s

    # ----------------------------------------------------------------- choice

    def choose(self, keys: Sequence, num_tokens: int | None = None,
               exclude: Sequence[Backend] = ()) -> tuple[Backend, Ticket]:
        """The backend for a prompt (text or token ids), counted as in flight there
        until ``release``. Raises LookupError when none is up."""
        ticket = self.policy.route(keys, num_tokens, exclude=[b.index for b in exclude])
        backend = self.backends[ticket.target]
        backend.requests_total += 1
        return backend, ticket

    def least_loaded(self) -> tuple[Backend, Ticket]:
        """For requests without a prompt (tokenize, detokenize)."""
        return self.choose(())

    def release(self, ticket: Ticket) -> None:
        self.policy.release(ticket)

    def in_flight(self, backend: Backend) -> int:
        return self.policy.loads[backend.index].requests

    @property
    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    # ----------------------------------------------------------------- health

    def mark_down(self, backend: Backend, reason: str) -> None:
        backend.failures_total += 1
        self._set_health(backend, False, reason)

    async def start(self) -> None:
        await self.check_all()

    async def run_health_checks(self) -> None:
        """Check every backend every interval, until cancelled."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(backend) for backend in self.backends))

    async def _check(self, backend: Backend) -> None:
        try:
            response = await self.client.get(f"{backend.url}/health",
                                             timeout=self.check_timeout_s)
        except httpx.HTTPError as error:
            self._set_health(backend, False, f"{type(error).__name__}: {error}".rstrip(": "))
        else:
            if response.status_code == 200:
                self._set_health(backend, True, None)
            else:
                self._set_health(backend, False,
                                 f"/health answered {response.status_code}: {response.text[:200]}")
        backend.last_check = time.time()

    def _set_health(self, backend: Backend, healthy: bool, reason: str | None) -> None:
        if backend.healthy != healthy:
            if healthy:
                logger.info("backend %s is up", backend.url)
            else:
                logger.warning("backend %s is down: %s", backend.url, reason)
        backend.healthy = healthy
        backend.last_error = reason
        self.policy.set_available(backend.index, healthy)

    def describe(self) -> list[dict]:
        """What the router's /health lists."""
        return [{"url": b.url, "healthy": b.healthy, "in_flight": self.in_flight(b),
                 "requests_total": b.requests_total, "failures_total": b.failures_total,
                 "error": b.last_error} for b in self.backends]


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``; a path such as
    ``/v1`` is refused (the router adds the routes' own paths)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--backend {url!r} is not an http(s)://HOST:PORT address")
    if parsed.path not in ("", "/"):
        raise ValueError(f"--backend {url!r} has a path; give the server's root "
                         "(http://HOST:PORT), not its /v1")
    return url
