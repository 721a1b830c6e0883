"""The control plane of ``loom serve --enable-control-endpoints`` on a real
server: weight updates equal a fresh engine on the new checkpoint (TP=1 and TP=2),
pause in mode wait and abort, requests held while paused, sleep and wake_up (worker RSS
printed), FastDeploy's aliases, refused updates, the API key, off by default."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch
from loom_server import TINY_SERVER_ARGS, LoomServer
from weight_variants import make_variant

from loom import LLM, SamplingParams

SEED_B = 4242
PROMPTS = [list(range(3, 67)), [5, 6, 7]]
MAX_TOKENS = 8
LONG = 200  # tokens of the request that runs while generation pauses
ARGS = ("--dtype", "float32", "--enable-control-endpoints")


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    b = make_variant(tiny_model_dir, str(tmp_path_factory.mktemp("control-b")), SEED_B)
    return tiny_model_dir, b


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[str]]:
    """Greedy completions of fresh offline engines on A and on B."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result = {}
    for name, path in zip("AB", checkpoints):
        with LLM(path, dtype="float32", max_model_len=512, enable_warm_up=False) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                   use_tqdm=False)
            result[name] = [o.outputs[0].text for o in outputs]
            if name == "A":
                long = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
                [output] = llm.generate({"prompt_token_ids": PROMPTS[0]}, long, use_tqdm=False)
                result["A long"] = output.outputs[0].text
    assert result["A"] != result["B"]
    return result


def complete(client: httpx.Client, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    response = client.post("/v1/completions", json={
        "model": client.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def stream_in_background(client: httpx.Client, prompt: list[int], max_tokens: int):
    """A streamed completion in a thread; returns once its first token has arrived (so it
    runs in the engine), with the thread and the dict its text and finish_reason go to."""
    import json

    result = {"text": ""}
    started = threading.Event()

    def run():
        with client.stream("POST", "/v1/completions", json={
                "model": client.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"] or result.get("finish_reason")
                started.set()
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    return thread, result


def tokens(client: httpx.Client) -> list[str]:
    """The greedy completions' texts (the tiny tokenizer decodes token ids one to one)."""
    return [complete(client, prompt)["text"] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, *ARGS, "--dynamic-load-weight",
                        api_key="secret")
    yield server
    server.kill()


@pytest.fixture
def client(server):
    with server.http() as client:
        client.model = os.path.basename(server.proc.args[4].rstrip("/"))
        yield client


def test_update_weights_equals_a_fresh_engine_and_refusals_keep_serving(
        client, checkpoints, expected, tmp_path):
    a, b = checkpoints
    assert tokens(client) == expected["A"]
    wrong_shape = make_variant(a, str(tmp_path / "wrong"), 5, edit={
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)})
    response = client.post("/update_weights", json={"path": wrong_shape})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "down_proj" in error["message"] and "unchanged" in error["message"]
    response = client.post("/update_weights", json={"path": str(tmp_path / "nowhere")})
    assert response.status_code == 400 and "no weights at" in response.json()["error"]["message"]
    assert tokens(client) == expected["A"]

    response = client.post("/update_weights", json={"path": b})
    assert response.status_code == 200, response.text
    print(f"POST /update_weights: {response.json()['seconds']:.3f}s")
    assert tokens(client) == expected["B"]  # the long prompt's A blocks are not reused
    assert client.post("/update_weights", json={"path": a}).status_code == 200
    assert tokens(client) == expected["A"]
    assert client.post("/reset_prefix_cache").json() == {"success": True, "reset": True}


@pytest.fixture
def restore(client, checkpoints):
    """Whatever a test leaves, the next finds generation running on A (an update also
    wakes a sleeping engine)."""
    yield
    assert client.post("/resume_generation").status_code == 200
    assert client.post("/update_weights", json={"path": checkpoints[0]}).status_code == 200


def test_pause_abort_ends_running_requests_and_holds_new_ones(client, checkpoints, expected,
                                                             restore):
    a, b = checkpoints
    # Sixteen long requests in one batch (the tiny model decodes in a millisecond a step;
    # together they take long enough for the pause to find them running).
    others = {}
    threads = [threading.Thread(target=lambda i=i: others.update(
        {i: complete(client, PROMPTS[0], max_tokens=440)})) for i in range(15)]
    for thread in threads:
        thread.start()
    stream, long = stream_in_background(client, PROMPTS[0], max_tokens=440)
    response = client.post("/pause_generation", json={"mode": "abort"})
    assert response.status_code == 200, response.text
    for thread in threads + [stream]:
        thread.join(30)
    reasons = [long["finish_reason"]] + [choice["finish_reason"] for choice in others.values()]
    assert len(reasons) == 16 and set(reasons) <= {"abort", "length"}
    assert "abort" in reasons, "every request finished before the pause arrived"

    # Sent while paused: held, then run on B after the update and the resume.
    finished = {}
    held = threading.Thread(target=lambda: finished.update(held=complete(client, PROMPTS[0])))
    held.start()
    time.sleep(0.5)
    assert "held" not in finished, "a request ran while generation was paused"
    assert client.post("/update_weights", json={"path": b}).status_code == 200
    assert "held" not in finished
    assert client.post("/resume_generation").status_code == 200
    held.join(30)
    assert finished["held"]["text"] == expected["B"][0]


def test_pause_wait_lets_running_requests_finish_on_the_old_weights(client, checkpoints,
                                                                   expected, restore):
    a, b = checkpoints
    thread, long = stream_in_background(client, PROMPTS[0], max_tokens=LONG)
    response = client.post("/pause_generation", json={"mode": "wait"})
    assert response.status_code == 200  # answered once the running request finished
    thread.join(30)
    assert long["finish_reason"] == "length"
    assert long["text"] == expected["A long"]  # every token on A
    assert client.post("/update_weights", json={"path": b}).status_code == 200
    assert client.post("/resume_generation").status_code == 200
    assert tokens(client) == expected["B"]


def test_sleep_and_wake_up(client, server, expected, restore):
    workers = server.worker_processes()
    before = sum(worker.memory_info().rss for worker in workers)
    response = client.post("/sleep", json={"level": 1})
    assert response.status_code == 200, response.text
    freed = response.json()["kv_cache_bytes_freed"]
    asleep = sum(worker.memory_info().rss for worker in workers)
    print(f"POST /sleep level 1: worker RSS {before / 2**20:.1f} -> {asleep / 2**20:.1f} MiB "
          f"(KV cache {freed / 2**20:.1f} MiB)")
    assert before - asleep >= 0.9 * freed > 0
    assert client.get("/is_sleeping").json()["is_sleeping"] is True
    assert client.post("/wake_up").status_code == 200
    assert client.get("/is_sleeping").json()["is_sleeping"] is False
    assert tokens(client) == expected["A"]

    assert client.post("/sleep", json={"level": 2}).status_code == 200
    assert client.post("/wake_up").status_code == 200
    assert tokens(client) == expected["A"]
    assert client.post("/sleep", json={"level": 3}).status_code == 400


def test_fastdeploy_aliases(client, checkpoints, expected, restore):
    a, b = checkpoints
    assert client.get("/clear_load_weight").status_code == 200
    assert client.get("/is_sleeping").json()["is_sleeping"] is True
    response = client.get("/update_model_weight", params={"path": b})
    assert response.status_code == 200, response.text
    assert client.get("/is_sleeping").json()["is_sleeping"] is False
    assert tokens(client) == expected["B"]
    assert client.post("/update_model_weight", json={"path": a}).status_code == 200
    assert tokens(client) == expected["A"]


def test_control_routes_need_the_key(server, tiny_model_dir):
    response = httpx.post(f"{server.url}/update_weights", json={"path": tiny_model_dir})
    assert response.status_code == 401


def in_process_app(tmp_path, control_endpoints: bool, answer=None):
    """The real app over ScriptedEngine, whose ``control`` calls ``answer``."""
    from fastapi.testclient import TestClient
    from scripted_engine import ScriptedEngine
    from tokenizer_fixtures import make_tiny_tokenizer

    from loom.entrypoints.openai.server import ServerState, build_app
    from loom.tokenizer import load_tokenizer

    tokenizer_dir = make_tiny_tokenizer(str(tmp_path))
    engine = ScriptedEngine.on(load_tokenizer(tokenizer_dir), tokenizer_dir, max_model_len=128)
    calls = []

    async def control(method, **kwargs):
        calls.append((method, kwargs))
        return answer(method, kwargs) if answer else None

    engine.control = control
    state = ServerState(engine, "tiny", api_key=None, shutdown_timeout=1.0)
    state.control_endpoints = control_endpoints
    return TestClient(build_app(state)), calls


def test_control_routes_are_off_by_default(tmp_path):
    client, calls = in_process_app(tmp_path, control_endpoints=False)
    for path in ("/update_weights", "/sleep", "/pause_generation", "/clear_load_weight",
                 "/update_model_weight", "/reset_prefix_cache"):
        assert client.post(path, json={}).status_code == 404
    assert calls == []


def test_control_errors_are_openai_envelopes(tmp_path):
    from loom.async_llm import ControlError

    def answer(method, kwargs):
        if method == "update_weights":
            raise ControlError("no weights at '/x'", "FileNotFoundError")
        if method == "sleep":
            raise ControlError("cannot sleep while 2 request(s) are in flight", "RuntimeError")
        return {"is_sleeping": False, "paused": True} if method == "status" else None

    client, calls = in_process_app(tmp_path, control_endpoints=True, answer=answer)
    response = client.post("/update_weights", json={"path": "/x"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "no weights at '/x'"
    assert client.post("/sleep", json={"level": 1}).status_code == 409
    assert client.post("/sleep", json={"level": "two"}).status_code == 400
    assert client.post("/pause_generation", json={"mode": "later"}).status_code == 400
    assert client.post("/update_weights", json={"path": 3}).json()["error"]["param"] == "path"
    assert client.post("/update_weights", content=b"[1]").status_code == 400
    assert client.get("/is_sleeping").json() == {"is_sleeping": False, "paused": True}
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    assert ("pause_generation", {"mode": "abort"}) in calls


def test_tensor_parallel_update_through_the_server(checkpoints, expected):
    a, b = checkpoints
    server = LoomServer(a, *TINY_SERVER_ARGS, *ARGS, "--tensor-parallel-size", "2")
    try:
        with server.http() as client:
            client.model = os.path.basename(a.rstrip("/"))
            assert tokens(client) == expected["A"]
            assert client.post("/update_weights", json={"path": b}).status_code == 200
            assert tokens(client) == expected["B"]
    finally:
        server.kill()
