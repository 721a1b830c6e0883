"""Never wedged, never half-alive, on a real ``loom serve``: a stuck worker or engine core
is found within its bound (stacks in the log, requests failed, 503, exit 1, nothing left
behind); /health says "loading" until the model is in; a deep probe generates; a whole
process group killed with SIGKILL leaves debris that the next start removes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from loom_server import REPO_ROOT, TINY_SERVER_ARGS, LoomServer


def loom_entries(pids: list[int]) -> set[str]:
    """The /dev/shm segments owned by these processes (others may run tests beside us)."""
    return {name for name in os.listdir("/dev/shm")
            if any(name.startswith(f"loom-{pid}-") for pid in pids)}


def alive(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{pid}: {' '.join(process.cmdline())[:200]}")
    return found


def server_pids(server: LoomServer) -> list[int]:
    return [server.proc.pid] + [p.pid for p in psutil.Process(server.proc.pid).children(True)]


@pytest.mark.parametrize("stuck", ["worker", "engine core"])
def test_a_stuck_process_fails_requests_turns_health_503_and_exits_1(start_server, stuck):
    hook = ("LOOM_TEST_STALL_WORKER_AT_STEP" if stuck == "worker"
            else "LOOM_TEST_STALL_ENGINE_AT_STEP")
    # The engine core's bound: 2 s + 20 ms x 64 tokens + 5 s margin = 8.3 s.
    server = start_server("--watchdog-timeout", "2", "--max-num-batched-tokens", "64",
                          env={hook: "3"})
    pids = server_pids(server)
    assert loom_entries(pids)
    started = time.monotonic()
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 30,
                                                      "ignore_eos": True})
        elapsed = time.monotonic() - started
        assert response.status_code >= 500
        assert "hung" in response.json()["error"]["message"]
        assert elapsed < (2 + 5 if stuck == "worker" else 8.3 + 5)
        health = http.get("/health")
        assert health.status_code == 503 and "hung" in health.json()["status"]
    assert server.proc.wait(30) == 1
    log = server.output()
    assert "most recent call first" in log  # faulthandler's stacks of the stuck process
    assert ("_stall_forever" if stuck == "worker" else "run_engine_core") in log
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits last
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids)
    assert not loom_entries(pids)


def test_health_answers_loading_until_the_model_is_in_then_generates(tiny_model_dir):
    command = [sys.executable, "-m", "loom.cli", "serve", tiny_model_dir, "--port", "0",
               *TINY_SERVER_ARGS]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = re.search(r"listening on (http://\S+)", proc.stdout.readline()).group(1)
        statuses = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            response = httpx.get(f"{url}/health", timeout=10)
            statuses.append((response.status_code, response.text))
            if response.status_code == 200:
                break
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
            if refused.status_code != 200:  # (it may have become ready in between)
                assert refused.status_code == 503
                assert "loading" in refused.json()["error"]["message"]
            time.sleep(0.05)
        assert statuses[0] == (503, '{"status":"loading"}')
        assert statuses[-1][0] == 200
        probe = httpx.get(f"{url}/health_generate", timeout=60)
        assert probe.status_code == 200 and probe.json()["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_after_a_sigkill_of_the_whole_group_the_next_start_removes_the_debris(start_server):
    first = start_server()
    first_pids = server_pids(first)
    assert loom_entries(first_pids)  # the worker signals of the first server
    os.killpg(first.proc.pid, signal.SIGKILL)  # as the OOM killer or `docker kill` would
    # SIGKILL lands when each process is next scheduled, and a big process takes a while
    # to tear down: the leader reaped says nothing of the engine core and the workers.
    # The next start removes only what belongs to PIDs that no longer run (a zombie does
    # not), so wait until every process of the group is dead or a zombie.
    first.proc.wait(120)
    deadline = time.monotonic() + 120
    while alive(first_pids):
        assert time.monotonic() < deadline, (
            f"the SIGKILLed group still runs after 120 s: {alive(first_pids)}")
        time.sleep(0.05)
    assert loom_entries(first_pids)  # nobody lived to unlink them
    second = start_server()
    second_pids = server_pids(second)
    assert not loom_entries(first_pids)
    assert "removed" in second.output() and "no longer run" in second.output()
    assert second.terminate() == 0
    assert not loom_entries(first_pids + second_pids)  # /dev/shm as before the first
