"""``loom serve --data-parallel-size 2``: two engine cores behind one API server, each
tensor parallel, with the control routes; and replicas on several hosts (``--headless``),
here three processes on one host over 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from loom_server import (TINY_SERVER_ARGS, LoomServer, _spawned_children, headless_log,
                         start_headless)

GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
PROMPTS = [f"request {i} of the batch" for i in range(8)]


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    """One replica, TP=1: the tokens every data-parallel layout must answer with. Started
    in the background (a future), beside the servers the tests start."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(LoomServer, tiny_model_dir, *TINY_SERVER_ARGS)
        yield future
    if future.exception() is None:
        future.result().kill()


@pytest.fixture(scope="module")
def expected(single):
    """expected(): the single replica's greedy tokens for PROMPTS (waits for it once)."""
    tokens: list[list[str]] = []

    def get() -> list[list[str]]:
        if not tokens:
            with ThreadPoolExecutor(8) as pool:
                tokens.extend(pool.map(lambda p: _complete(single.result(), p), PROMPTS))
        return tokens

    return get


def _complete(server: LoomServer, prompt: str) -> list[str]:
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, **GREEDY},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_two_tensor_parallel_replicas_answer_as_one_share_the_work_keep_prefixes_and_fail_fast(
        start_server, expected):
    # DP 2 x TP 2: four worker ranks, two engine cores, one API server.
    dp = start_server("--data-parallel-size", "2", "--tensor-parallel-size", "2",
                      "--enable-control-endpoints")
    assert "in each of 2 data-parallel replicas" in dp.output()
    # each rank takes a quarter of the cores by default (at least one thread)
    cores = len(os.sched_getaffinity(0))
    threads = re.findall(r"rank (\d) of data-parallel replica (\d): (\d+) torch threads",
                         dp.output())
    assert sorted(threads) == [(rank, replica, str(max(1, cores // 4)))
                               for rank in "01" for replica in "01"], threads

    # A batch at once: the same greedy tokens as one TP=1 replica, spread over both.
    with ThreadPoolExecutor(8) as pool:
        routed = list(pool.map(lambda p: _complete(dp, p), PROMPTS))
    assert routed == expected()
    finished = dp.metric_by_replica("vllm:request_success_total")
    assert set(finished) == {"0", "1"} and all(v >= 2 for v in finished.values()), finished
    assert sum(finished.values()) == len(PROMPTS)

    _control_routes_answer_for_every_replica(dp, expected())

    # Requests sharing a long prefix go to the replica holding it: only its prefix-cache
    # hit counter grows, however idle the other one is.
    shared = "Answer in one word, please, and be kind to the reader. " * 4
    before = dp.metric_by_replica("vllm:prefix_cache_hits_total")
    for i in range(4):
        _complete(dp, shared + f"question {i}")
    after = dp.metric_by_replica("vllm:prefix_cache_hits_total")
    grew = [replica for replica in after if after[replica] > before[replica]]
    assert len(grew) == 1, (before, after)
    # the three after the first each find the shared blocks (well over 128 tokens)
    assert after[grew[0]] - before[grew[0]] >= 3 * 128

    # One replica's engine core dies mid-run: its requests fail with its error, the other
    # replica's are aborted, /health turns 503 and the server exits non-zero.
    cores_procs = _spawned_children(psutil.Process(dp.proc.pid))
    assert len(cores_procs) == 2, cores_procs
    endings = _stream_endings_after(dp.url, cores_procs[1].kill)
    errors = [ending["error"] for ending in endings if "error" in ending]
    # the dead replica's requests fail with its error; the other's are aborted, or had
    # finished already
    assert "engine_dead" in [error["code"] for error in errors], endings
    assert all("replica" in error["message"] for error in errors), errors
    assert all(ending["choices"][0]["finish_reason"] == "length"
               for ending in endings if "error" not in ending), endings
    assert dp.proc.wait(30) != 0


def _stream_endings_after(url: str, kill) -> list[dict]:
    """Open 4 long streams, see each start, ``kill()`` a process, read every stream to
    its end; returns each one's last event (an error, or its last chunk) once /health
    answers 503."""
    long_stream = {"max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions",
                               json={**long_stream, "prompt": f"keep going {i}"})
                   for i in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]
        for line_iter in lines:
            assert next(line for line in line_iter if line).startswith("data: {")
        kill()
        endings = []
        for line_iter, stream in zip(lines, streams):
            events = [line for line in line_iter if line]
            assert events[-1] == "data: [DONE]"
            endings.append(json.loads(events[-2].removeprefix("data: ")))
            stream.__exit__(None, None, None)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    return endings


def _control_routes_answer_for_every_replica(dp: LoomServer, expected: list[list[str]]) -> None:
    """Each control route goes to both replicas and answers for both."""
    with dp.http() as http:
        response = http.post("/sleep", json={"level": 1})
        assert response.status_code == 200, response.text
        slept = response.json()
        assert len(slept["replicas"]) == 2
        assert slept["kv_cache_bytes_freed"] == sum(
            replica["kv_cache_bytes_freed"] for replica in slept["replicas"]) > 0
        assert http.get("/is_sleeping").json() == {
            "is_sleeping": True, "paused": False,
            "replicas": [{"is_sleeping": True, "paused": False}] * 2}
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json()["is_sleeping"] is False
        # refused by every replica: the caller's fault, each replica named
        response = http.post("/update_weights", json={"path": "/nowhere/at/all"})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "failed on 2 of 2 data-parallel replicas" in message, message
        assert "replica 0: " in message and "replica 1: " in message
        assert message.count("no weights at") == 2, message
        assert http.post("/pause_generation", json={"mode": "abort"}).json()["paused"] is True
        assert http.get("/is_sleeping").json()["paused"] is True
        assert http.post("/resume_generation").status_code == 200
        assert http.post("/reset_prefix_cache").json() == {"success": True, "reset": True}
    assert _complete(dp, PROMPTS[0]) == expected[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


HEADLESS_ARGS = (*TINY_SERVER_ARGS, "--cpu-threads-per-rank", "1")


def test_replicas_on_three_hosts_answer_as_one_and_a_dead_host_fails_the_server(
        tiny_model_dir, expected):
    """Head (API server + replica 0) and two headless hosts (replicas 1 and 2), as three
    processes on this host."""
    port = _free_port()
    head_args = (*TINY_SERVER_ARGS, "--data-parallel-size", "3", "--data-parallel-size-local",
                 "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
                 str(port), "--cpu-threads-per-rank", "1")
    processes = []
    try:
        with ThreadPoolExecutor(1) as pool:
            head_future = pool.submit(LoomServer, tiny_model_dir, *head_args)
            # A host configured differently is refused by name (whether or not the right
            # one came first), and starts nothing.
            doomed, survivor = (start_headless(tiny_model_dir, port, rank, 3, *HEADLESS_ARGS)
                                for rank in (1, 2))
            wrong = start_headless(tiny_model_dir, port, 2, 3, *HEADLESS_ARGS,
                                   "--max-num-seqs", "8")
            processes += [doomed, survivor, wrong]
            assert wrong.wait(120) == 2, headless_log(wrong)
            assert "--max-num-seqs is 8 there, 64 on the head" in headless_log(wrong), headless_log(wrong)
            head = head_future.result()
        processes.append(head)
        assert head.output().count("joined from host") == 2

        with ThreadPoolExecutor(8) as pool:
            routed = list(pool.map(lambda p: _complete(head, p), PROMPTS))
        assert routed == expected()
        finished = head.metric_by_replica("vllm:request_success_total")
        assert set(finished) == {"0", "1", "2"} and all(v >= 1 for v in finished.values()), \
            finished

        # A headless host dies mid-run: its replica's requests fail, the head's /health
        # turns 503 and it exits non-zero, stopping the other headless host on its way out
        # (as on SIGTERM: its engine core told to stop, then goodbye), which exits 0.
        endings = _stream_endings_after(head.url, doomed.kill)
        errors = [ending["error"] for ending in endings if "error" in ending]
        assert any("data-parallel replica 1" in error["message"] and "headless" in
                   error["message"] for error in errors), endings
        assert head.proc.wait(30) != 0
        assert survivor.wait(30) == 0, headless_log(survivor)
        assert "the head shut down; engine core exit codes {2: 0}" in headless_log(survivor)
    finally:
        for proc in processes:
            if isinstance(proc, LoomServer):
                proc.kill()
            elif proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait(10)
