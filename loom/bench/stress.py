"""Stress and soak against a running server: look for the next wedge, measure drift.

A *round* fires one mix at the server at once, the mixes that wedged loom before:
concurrent structured outputs beside plain completions, abort storms right
after submission, interleaved streaming and non-streaming chat, n > 1, long greedy
requests that press the KV cache into preemption (and drafts, if the server runs
speculative decoding). After each round the server must come back to empty within
``settle_s``:

    vllm:num_requests_running = vllm:num_requests_waiting = 0
    loom:engine_requests = loom:kv_blocks_in_use = loom:server_requests_in_flight = 0

and a probe (``/health_generate``) must answer 200. Anything else is a wedge or a leak,
reported with the gauges as they stood.

A *soak* runs a realistic mix at a fixed concurrency for a duration and samples, every
``sample_s``, the resident memory of every server process and the window's latency
percentiles; at the end it checks the empty state as a round does.

``CpuHog`` runs busy processes on the same cores meanwhile, as the parallel C++ build
that first showed the wedge did. Only loopback addresses are used; every loop is
bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import psutil

EMPTY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "loom:engine_requests",
                "loom:kv_blocks_in_use", "loom:server_requests_in_flight")
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"]}
WORDS = ("the river runs north past old stone mills while keepers count the boats and "
         "lanterns swing above the docks").split()


class WedgeError(AssertionError):
    """The server did not come back to empty, or its probe failed, after a round."""


@dataclass
class RoundReport:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)  # unexpected statuses or bodies
    seconds: float = 0.0


class CpuHog:
    """``processes`` busy loops on this machine's cores for the life of the context."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._procs: list[multiprocessing.Process] = []

    def __enter__(self) -> CpuHog:
        context = multiprocessing.get_context("spawn")
        for _ in range(self.processes):
            process = context.Process(target=_spin, daemon=True)
            process.start()
            self._procs.append(process)
        return self

    def __exit__(self, *exc) -> None:
        for process in self._procs:
            process.kill()
            process.join(5)


def _spin() -> None:
    while True:
        pass


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _post(client: httpx.AsyncClient, path: str, body: dict, report: RoundReport) -> None:
    report.requests += 1
    response = await client.post(path, json=body)
    if response.status_code == 200:
        report.completed += 1
    elif response.status_code >= 500 or "error" not in response.json():
        report.errors.append(f"{path} {response.status_code}: {response.text[:200]}")


async def _stream(client: httpx.AsyncClient, path: str, body: dict, report: RoundReport,
                  abort_after_events: int | None) -> None:
    """Stream ``body``; with ``abort_after_events`` close the connection after that many
    events (0: right after submission, before any token)."""
    report.requests += 1
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            if response.status_code >= 500:
                report.errors.append(f"{path} stream {response.status_code}")
            return
        if abort_after_events == 0:
            report.aborted += 1
            return
        events = 0
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                report.completed += 1
                return
            payload = json.loads(line.removeprefix("data: "))
            if "error" in payload:
                report.errors.append(f"{path} stream error: {payload['error']['message']}")
                return
            events += 1
            if abort_after_events is not None and events >= abort_after_events:
                report.aborted += 1
                return
    report.errors.append(f"{path} stream ended without [DONE]")


def _request(client: httpx.AsyncClient, rng: random.Random, report: RoundReport, kind: int,
             max_tokens: int):
    """One request of the mix, by ``kind`` (0..7)."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    user = [{"role": "user", "content": _prompt(rng, rng.randint(3, 30))}]
    if kind == 0:  # structured output
        return _post(client, chat, {"messages": user, "max_tokens": max_tokens,
                                    "response_format": {"type": "json_schema", "json_schema":
                                                        {"name": "p", "schema": PERSON_SCHEMA}}},
                     report)
    if kind == 1:  # plain greedy completion
        return _post(client, completions, {"prompt": _prompt(rng, 8), "temperature": 0,
                                           "max_tokens": max_tokens}, report)
    if kind == 2:  # aborted right after submission
        return _stream(client, completions, {"prompt": _prompt(rng, 40),
                                             "max_tokens": 4 * max_tokens}, report, 0)
    if kind == 3:  # aborted mid-stream
        return _stream(client, chat, {"messages": user, "max_tokens": 4 * max_tokens}, report,
                       rng.randint(1, 4))
    if kind == 4:  # streamed chat to the end
        return _stream(client, chat, {"messages": user, "max_tokens": max_tokens}, report, None)
    if kind == 5:  # n > 1, sampled
        return _post(client, completions, {"prompt": _prompt(rng, 12), "n": 3,
                                           "temperature": 0.8, "seed": rng.randrange(2**31),
                                           "max_tokens": max_tokens}, report)
    if kind == 6:  # long and greedy: KV pressure, preemption
        return _post(client, completions, {"prompt": _prompt(rng, 60), "temperature": 0,
                                           "ignore_eos": True, "max_tokens": 3 * max_tokens},
                     report)
    return _post(client, completions, {"prompt": "x", "max_tokens": -1}, report)  # a bad one


NUM_KINDS = 8


async def stress_round(url: str, rng: random.Random, size: int = 32, max_tokens: int = 16,
                       settle_s: float = 60.0) -> RoundReport:
    """One mixed round, then the empty-state check and the probe; raises WedgeError."""
    report = RoundReport()
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(_request(client, rng, report, i % NUM_KINDS, max_tokens)
                               for i in range(size)))
        await wait_until_empty(client, settle_s)
    report.seconds = time.monotonic() - started
    return report


async def wait_until_empty(client: httpx.AsyncClient, settle_s: float) -> None:
    deadline = time.monotonic() + settle_s
    while True:
        gauges = await read_gauges(client)
        if not any(gauges[name] for name in EMPTY_GAUGES):
            break
        if time.monotonic() > deadline:
            raise WedgeError(f"not empty {settle_s:g}s after the round: {gauges}")
        await asyncio.sleep(0.1)
    probe = await client.get("/health_generate", params={"timeout": settle_s})
    if probe.status_code != 200:
        raise WedgeError(f"probe failed after the round: {probe.status_code} {probe.text}")


async def read_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    gauges = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in EMPTY_GAUGES:
            gauges[name] = float(line.rsplit(" ", 1)[1])
    missing = set(EMPTY_GAUGES) - set(gauges)
    if missing:
        raise WedgeError(f"/metrics lacks {sorted(missing)}")
    return gauges


# ----------------------------------------------------------------- soak


@dataclass
class SoakSample:
    minute: float
    requests: int
    p50_s: float
    p99_s: float
    rss_mib: dict[str, float]  # process role -> resident MiB


def server_processes(server_pid: int) -> dict[str, psutil.Process]:
    """The API server, its engine core and the core's workers, by role."""
    api = psutil.Process(server_pid)
    roles = {"api": api}
    spawned = [c for c in api.children() if any("spawn_main" in p for p in c.cmdline())]
    if spawned:
        roles["engine-core"] = spawned[0]
        workers = [c for c in spawned[0].children()
                   if any("spawn_main" in p for p in c.cmdline())]
        roles.update({f"worker-{i}": worker for i, worker in enumerate(workers)})
    return roles


async def soak(url: str, server_pid: int, minutes: float, concurrency: int = 8,
               max_tokens: int = 32, sample_s: float = 60.0, seed: int = 0,
               request_timeout_s: float = 120.0) -> tuple[list[SoakSample], RoundReport, int]:
    """Returns (samples, what the requests got, stuck): a request is stuck when it takes
    longer than ``request_timeout_s``. Ends with the empty-state check."""
    rng = random.Random(seed)
    processes = server_processes(server_pid)
    end = time.monotonic() + minutes * 60
    latencies: list[float] = []
    samples: list[SoakSample] = []
    stuck = 0
    report = RoundReport()
    started = time.monotonic()
    next_sample = started + sample_s

    async with httpx.AsyncClient(base_url=url, timeout=request_timeout_s) as client:
        async def one_client(index: int) -> None:
            nonlocal stuck
            while time.monotonic() < end:
                begun = time.monotonic()
                try:
                    await _request(client, rng, report, rng.randrange(NUM_KINDS), max_tokens)
                except httpx.TimeoutException:
                    stuck += 1
                latencies.append(time.monotonic() - begun)

        async def sampler() -> None:
            nonlocal next_sample
            while time.monotonic() < end:
                await asyncio.sleep(max(0.0, next_sample - time.monotonic()))
                window, latencies[:] = list(latencies), []
                samples.append(SoakSample(
                    minute=(time.monotonic() - started) / 60, requests=len(window),
                    p50_s=statistics.median(window) if window else float("nan"),
                    p99_s=_percentile(window, 99),
                    rss_mib={role: p.memory_info().rss / 2**20 for role, p in processes.items()}))
                next_sample += sample_s

        await asyncio.gather(sampler(), *(one_client(i) for i in range(concurrency)))
        await wait_until_empty(client, settle_s=60.0)
    return samples, report, stuck


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
