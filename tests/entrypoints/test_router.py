"""``loom router`` over two real ``loom serve`` processes on the tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from loom_server import REPO_ROOT, LoomServer

_READY = re.compile(r"ready on (http://\S+)")
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


class RouterProcess:
    """``loom router --port 0 --backend ...``; waits for its "ready on" line."""

    def __init__(self, *backends: str, args: tuple[str, ...] = ()) -> None:
        command = [sys.executable, "-m", "loom.cli", "router", "--port", "0",
                   "--health-check-interval", "0.3", *args]
        for backend in backends:
            command += ["--backend", backend]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="loom-router-", suffix=".log")
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1,
                                     start_new_session=True)
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                match = _READY.search(line)
                if match:
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120):
            self.close()
            raise RuntimeError(f"loom router did not start:\n{self.output()}")

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def wait_for_health(self, predicate, what: str = "the awaited state",
                        timeout: float = 120.0) -> dict:
        """The router's /health body once ``predicate`` holds; fails saying ``what`` it
        waited for if that takes over ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.health().json()
            if predicate(body):
                return body
            assert time.monotonic() < deadline, (
                f"the router's /health did not show {what} in {timeout:g} s: {body}")
            time.sleep(0.1)

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _completion(http: httpx.Client, prompt: str) -> tuple[str, str]:
    response = http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers.get("x-loom-backend", "")


def _signal_all(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        process.send_signal(signum)


def _up(body: dict) -> list[str]:
    return [b["url"] for b in body["backends"] if b["healthy"]]


def _prefix_hits(server: LoomServer) -> float:
    return server.metric("vllm:prefix_cache_hits_total")


@pytest.fixture
def router_factory():
    routers = []

    def make(*backends: str, args: tuple[str, ...] = ()) -> RouterProcess:
        routers.append(RouterProcess(*backends, args=args))
        return routers[-1]

    yield make
    for router in routers:
        router.close()


def test_router_balances_keeps_affinity_survives_a_dead_backend_and_takes_it_back(
        start_server, tiny_model_dir, router_factory):
    with ThreadPoolExecutor(2) as pool:  # the two start side by side
        first, second = pool.map(lambda _: start_server(), range(2))
    # A loaded host can keep a busy backend's /health waiting past the router's default
    # 2 s check timeout: the router would take a live backend out (forgetting its prefix
    # affinity) and the load and affinity checks below would see the wrong backend. A
    # killed backend refuses at once, so a long timeout leaves its detection as quick.
    router = router_factory(first.url, second.url, args=("--health-check-timeout", "60"))
    body = router.health().json()  # checked once before "ready"
    assert body["status"] == "ok", body

    # Same tokens as one server; distinct short prompts are spread by load.
    prompts = [f"prompt number {i} says" for i in range(6)]
    with first.http() as direct:
        expected = [_completion(direct, p)[0] for p in prompts]
    with router.http() as http:
        routed = [_completion(http, p) for p in prompts]
    assert [text for text, _ in routed] == expected
    assert {backend for _, backend in routed} == {first.url, second.url}

    # Requests sharing a long prefix go where it was sent first: only that backend's
    # prefix cache is hit, even while the other is idle.
    shared = "You are a careful assistant. " * 8
    hits_before = [_prefix_hits(first), _prefix_hits(second)]
    with router.http() as http:
        placed = [_completion(http, shared + f"question {i}?")[1] for i in range(4)]
    assert len(set(placed)) == 1, placed
    holder = first if placed[0] == first.url else second
    other = second if holder is first else first
    holder_index = 0 if holder is first else 1
    assert _prefix_hits(holder) > hits_before[holder_index]
    assert _prefix_hits(other) == hits_before[1 - holder_index]

    # A stream passes through event by event; the router adds which backend answered.
    with router.http() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "stream me", "stream": True, **GREEDY}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 3

    with router.http() as http:
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [os.path.basename(tiny_model_dir)]
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()

    # Kill one backend mid-run: its streams end with an error event, the others finish.
    # The victim's engine is frozen while the streams open, thawed in slices of 20 ms
    # until it has written tokens, and killed frozen once one of its streams has sent an
    # event, so it cannot finish them first (unfrozen, the tiny model writes 400 tokens in under a second: waiting
    # for an event from each of its streams while it ran, and then for one while it ran,
    # lost that race on a loaded CI host: the event's way through the router took longer).
    long_stream = {"prompt": "keep going", "max_tokens": 480, "ignore_eos": True,
                   "stream": True}
    victim_port = second.url.rsplit(":", 1)[1]
    victim_engine = psutil.Process(second.proc.pid).children(recursive=True)
    _signal_all(victim_engine, signal.SIGSTOP)
    with router.http() as http:
        streams = [http.stream("POST", "/v1/completions",
                               json={**long_stream, "prompt": f"keep going {i}"})
                   for i in range(4)]
        opened = [s.__enter__() for s in streams]
        backends = [r.headers["x-loom-backend"] for r in opened]
        assert set(backends) == {first.url, second.url}, backends
        lines = [r.iter_lines() for r in opened]
        on_first = [it for it, b in zip(lines, backends) if b == first.url]
        on_second = [it for it, b in zip(lines, backends) if b == second.url]
        for line_iter in on_first:  # every stream is under way
            assert next(line for line in line_iter if line).startswith("data: {")
        with ThreadPoolExecutor(1) as reader:
            first_event = reader.submit(lambda: next(line for line in on_second[0] if line))
            # thawed only until its API server has received tokens (a loaded host
            # oversleeps a slice, and slices thawed while an event crawled through the
            # router once let the victim write all 480); then frozen for good
            written = second.metric("vllm:generation_tokens_total")
            deadline = time.monotonic() + 120
            while not first_event.done():
                assert time.monotonic() < deadline, "the victim's stream sent no event in 120 s"
                if second.metric("vllm:generation_tokens_total") == written:
                    _signal_all(victim_engine, signal.SIGCONT)
                    time.sleep(0.02)
                    _signal_all(victim_engine, signal.SIGSTOP)
                time.sleep(0.2)  # frozen: an event on its way through the router arrives
            assert first_event.result().startswith("data: {")
        second.kill()
        endings = []
        for line_iter, response in zip(lines, opened):
            events = [line for line in line_iter if line]
            endings.append(events[-2:])
            response.close()
    for backend, ending in zip(backends, endings):
        assert ending[-1] == "data: [DONE]"
        last = json.loads(ending[0].removeprefix("data: "))
        if backend == second.url:
            assert last.get("error", {}).get("code") == "backend_failed", (backend, endings)
        else:
            assert last["choices"][0]["finish_reason"] == "length", last

    body = router.wait_for_health(lambda b: _up(b) == [first.url],
                                  f"only {first.url} up after {second.url} was killed")
    assert body["status"] == "degraded" and _up(body) == [first.url]
    assert router.health().status_code == 200
    with router.http() as http:
        after = [_completion(http, p) for p in prompts[:3]]
    assert [text for text, _ in after] == expected[:3]
    assert {backend for _, backend in after} == {first.url}

    # The backend restarted on its port is taken back and gets work again.
    restarted = start_server("--port", victim_port)
    assert restarted.url == second.url
    body = router.wait_for_health(lambda b: len(_up(b)) == 2,
                                  f"{second.url} taken back after its restart")
    assert body["status"] == "ok", body
    with router.http() as http:
        again = [_completion(http, p) for p in prompts]
    assert [text for text, _ in again] == expected
    assert {backend for _, backend in again} == {first.url, second.url}

    # No backend up: 503 on /health and in OpenAI's envelope on the API.
    first.kill()
    restarted.kill()
    body = router.wait_for_health(lambda b: not _up(b), "no backend up after both were killed")
    assert router.health().status_code == 503 and body["status"] == "unavailable"
    with router.http() as http:
        refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "service_unavailable"


def test_router_refuses_bad_backends():
    result = subprocess.run([sys.executable, "-m", "loom.cli", "router", "--backend",
                             "http://127.0.0.1:1/v1"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "has a path" in result.stderr

