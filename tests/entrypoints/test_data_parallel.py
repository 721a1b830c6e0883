"""``loom serve --data-parallel-size 2``: two engine cores behind one API server."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
from loom_server import LoomServer, _spawned_children

GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


def _complete(server: LoomServer, prompt: str) -> list[str]:
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, **GREEDY},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def _by_replica(server: LoomServer, name: str) -> dict[str, float]:
    """{replica: value} of a metric summed over its other labels."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            replica = re.search(r'replica="(\d+)"', line).group(1)
            values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_two_replicas_answer_as_one_share_the_work_keep_prefixes_and_fail_fast(start_server):
    with ThreadPoolExecutor(2) as pool:  # the two servers start side by side
        dp, single = pool.map(lambda args: start_server(*args),
                              [("--data-parallel-size", "2"), ()])
    assert "in each of 2 data-parallel replicas" in dp.output()
    # each replica's rank takes half the cores by default
    cores = len(os.sched_getaffinity(0))
    threads = re.findall(r"data-parallel replica (\d): (\d+) torch threads", dp.output())
    assert sorted(threads) == [("0", str(max(1, cores // 2))), ("1", str(max(1, cores // 2)))]

    # A batch at once: the same greedy tokens as one replica, spread over both.
    prompts = [f"request {i} of the batch" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        routed = list(pool.map(lambda p: _complete(dp, p), prompts))
        expected = list(pool.map(lambda p: _complete(single, p), prompts))
    assert routed == expected
    finished = _by_replica(dp, "vllm:request_success_total")
    assert set(finished) == {"0", "1"} and all(v >= 2 for v in finished.values()), finished
    assert sum(finished.values()) == len(prompts)

    # Requests sharing a long prefix go to the replica holding it: only its prefix-cache
    # hit counter grows, however idle the other one is.
    shared = "Answer in one word, please, and be kind to the reader. " * 4
    before = _by_replica(dp, "vllm:prefix_cache_hits_total")
    for i in range(4):
        _complete(dp, shared + f"question {i}")
    after = _by_replica(dp, "vllm:prefix_cache_hits_total")
    grew = [replica for replica in after if after[replica] > before[replica]]
    assert len(grew) == 1, (before, after)
    # the three after the first each find the shared blocks (well over 128 tokens)
    assert after[grew[0]] - before[grew[0]] >= 3 * 128

    # One replica's engine core dies mid-run: its requests fail with its error, the other
    # replica's are aborted, /health turns 503 and the server exits non-zero.
    cores_procs = _spawned_children(psutil.Process(dp.proc.pid))
    assert len(cores_procs) == 2, cores_procs
    long_stream = {"max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=dp.url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions",
                               json={**long_stream, "prompt": f"keep going {i}"})
                   for i in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]
        for line_iter in lines:
            assert next(line for line in line_iter if line).startswith("data: {")
        cores_procs[1].kill()
        endings = []
        for line_iter, stream in zip(lines, streams):
            events = [line for line in line_iter if line]
            assert events[-1] == "data: [DONE]"
            endings.append(json.loads(events[-2].removeprefix("data: ")))
            stream.__exit__(None, None, None)
        assert httpx.get(f"{dp.url}/health", timeout=10).status_code == 503
    errors = [ending["error"] for ending in endings if "error" in ending]
    # the dead replica's requests fail with its error; the other's are aborted, or had
    # finished already
    assert "engine_dead" in [error["code"] for error in errors], endings
    assert all("replica" in error["message"] for error in errors), errors
    assert all(ending["choices"][0]["finish_reason"] == "length"
               for ending in endings if "error" not in ending), endings
    assert dp.proc.wait(30) != 0
