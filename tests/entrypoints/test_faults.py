"""Faults, each on its own server: a killed engine core or worker, SIGTERM drains."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import psutil
import pytest

# Held in flight by stream_held_in_flight, so its length need not outlast the test's
# reactions; it only has to run to its end after a drain.
LONG_STREAM = {"prompt": "keep going", "max_tokens": 64, "n": 4, "ignore_eos": True,
               "stream": True}


def read_events(lines) -> list:
    events = []
    for line in lines:
        if line:
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@contextlib.contextmanager
def stream_held_in_flight(server):
    """A streamed LONG_STREAM that is in flight for sure when the test signals the server:
    the engine core is stopped (SIGSTOP) before it is sent, so no token of it runs until
    ``resume()``. (Signalled after its first event instead, the tiny model on a quiet host,
    or with the test process descheduled on a busy one, could finish all 4 x 500 tokens
    first; the server, with nothing to drain, then stops at once and refuses /health:
    right for the server, but not what the test is about.) Yields ``(stream, resume)``;
    the server has taken the request once the response headers came."""
    core = server.engine_core_process()

    def resume() -> None:
        with contextlib.suppress(psutil.NoSuchProcess):  # a test may have killed it
            core.resume()

    core.suspend()
    try:
        with server.http() as http, http.stream("POST", "/v1/completions",
                                                json=LONG_STREAM) as stream:
            yield stream, resume
    finally:
        resume()


@pytest.mark.parametrize("victim", ["engine core", "worker"])
def test_killed_child_fails_requests_then_health_503_and_exit_nonzero(start_server, victim):
    server = start_server()
    with stream_held_in_flight(server) as (stream, resume):
        if victim == "engine core":
            target = server.engine_core_process()
        else:
            workers = server.worker_processes()
            assert workers, "loom serve runs its workers in their own processes"
            target = workers[0]
        target.send_signal(signal.SIGKILL)
        resume()
        events = read_events(stream.iter_lines())
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and events[-2] is errors[0], events[-3:]
    assert errors[0]["error"]["code"] == "engine_dead"
    with server.http() as http:
        health = http.get("/health")
        assert health.status_code == 503
        refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503
    assert server.proc.wait(30) != 0
    assert "engine" in server.output()


def test_worker_killed_while_idle_turns_health_503_and_exits_nonzero(start_server):
    server = start_server()
    server.worker_processes()[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    with server.http() as http:
        while http.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/health").status_code == 503
    assert server.proc.wait(30) != 0
    assert "worker" in server.output()


def assert_draining(server) -> None:
    """/health turns 503 and a new request gets 503 with Retry-After."""
    with server.http() as other:
        deadline = time.monotonic() + 5
        while other.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.get("/health").status_code == 503
        rejected = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"]


def assert_finished_whole(events: list) -> None:
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] * 4


def test_sigterm_drains_requests_in_flight_then_exits_zero(start_server):
    server = start_server("--shutdown-timeout", "60")
    with stream_held_in_flight(server) as (stream, resume):
        server.proc.send_signal(signal.SIGTERM)
        assert_draining(server)
        resume()
        events = read_events(stream.iter_lines())
    assert_finished_whole(events)
    assert server.proc.wait(30) == 0, server.output()


def test_ctrl_c_drains_like_sigterm(start_server):
    """SIGINT to the server's process group, as a terminal's Ctrl-C sends it: the stream in
    flight finishes, new requests get 503, the server exits 0."""
    server = start_server("--shutdown-timeout", "60")
    with stream_held_in_flight(server) as (stream, resume):
        os.killpg(server.proc.pid, signal.SIGINT)
        assert_draining(server)
        resume()
        events = read_events(stream.iter_lines())
    assert_finished_whole(events)
    assert server.proc.wait(30) == 0, server.output()


def test_sigterm_past_the_shutdown_timeout_aborts_and_exits_zero(start_server):
    server = start_server("--shutdown-timeout", "0")
    with stream_held_in_flight(server) as (stream, resume):
        server.proc.send_signal(signal.SIGTERM)
        events = read_events(stream.iter_lines())  # aborted by the API process itself
        resume()
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    assert server.proc.wait(30) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
