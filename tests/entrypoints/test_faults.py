"""Faults, each on its own server: a killed engine core or worker, SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

LONG_STREAM = {"prompt": "keep going", "max_tokens": 500, "n": 4, "ignore_eos": True,
               "stream": True}


def read_events(lines) -> list:
    events = []
    for line in lines:
        if line:
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def first_event(lines) -> dict:
    for line in lines:
        if line:
            return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended before its first event")


@pytest.mark.parametrize("victim", ["engine core", "worker"])
def test_killed_child_fails_requests_then_health_503_and_exit_nonzero(start_server, victim):
    server = start_server()
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
        lines = stream.iter_lines()
        first_event(lines)
        if victim == "engine core":
            target = server.engine_core_process()
        else:
            workers = server.worker_processes()
            assert workers, "loom serve runs its workers in their own processes"
            target = workers[0]
        target.send_signal(signal.SIGKILL)
        events = read_events(lines)
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


def test_sigterm_drains_requests_in_flight_then_exits_zero(start_server):
    server = start_server("--shutdown-timeout", "60")
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
        lines = stream.iter_lines()
        first = first_event(lines)
        server.proc.send_signal(signal.SIGTERM)
        with server.http() as other:
            deadline = time.monotonic() + 5
            while other.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert other.get("/health").status_code == 503
            rejected = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert rejected.status_code == 503
            assert rejected.headers["retry-after"]
        events = [first] + read_events(lines)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] * 4
    assert server.proc.wait(30) == 0, server.output()


def test_ctrl_c_drains_like_sigterm(start_server):
    """SIGINT to the server's process group, as a terminal's Ctrl-C sends it: the stream in
    flight finishes, new requests get 503, the server exits 0."""
    server = start_server("--shutdown-timeout", "60")
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
        lines = stream.iter_lines()
        first = first_event(lines)
        os.killpg(server.proc.pid, signal.SIGINT)
        with server.http() as other:
            deadline = time.monotonic() + 5
            while other.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert other.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        events = [first] + read_events(lines)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert server.proc.wait(30) == 0, server.output()


def test_sigterm_past_the_shutdown_timeout_aborts_and_exits_zero(start_server):
    server = start_server("--shutdown-timeout", "0")
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as stream:
        lines = stream.iter_lines()
        first_event(lines)
        server.proc.send_signal(signal.SIGTERM)
        events = read_events(lines)
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    assert server.proc.wait(30) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
