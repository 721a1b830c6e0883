"""Prefill/decode disaggregation between two ``loom serve -dp 2 --enable-expert-parallel``
instances (docs/disaggregation.md, docs/multi_node.md): each instance's MoE experts split
over its two replicas' ranks, the replicas in lock-step; ``loom router --prefill
--decode`` in front. A tiny random Qwen3-MoE, float32, greedy: what the router answers
equals one plain rank (``LLM``) token for token (the sampled tokens' logprobs, which
tell the token ids apart where the byte-level text does not), one request at a time
(each replica of each instance in turn works while its peer runs dummy steps: the
decode replica waiting for its blocks, the prefill replica freeing its held blocks
while the other steps) and all at once (both replicas of both instances busy). Then
both instances return to zero blocks in use and zero requests."""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from checkpoints import make_tiny_checkpoint
from loom_server import LoomServer
from test_router import RouterProcess
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams

MAX_TOKENS = 6
SERVER_ARGS = ("--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32",
               "--max-model-len", "256", "--num-gpu-blocks-override", "64",
               "--watchdog-timeout", "15")  # a lost lock-step: a hang within 15 s
PLAIN_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64")


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 6, 17, 40, 70)]
    return prompts + [shared + [7], shared + [9, 10]]  # the second a prefix-cache hit


def _one_rank(path: str, prompts: list[list[int]]) -> list[tuple[str, list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(path, dtype="float32", max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    return [(o.outputs[0].text, [entry[token].logprob for token, entry in
                                 zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


def _complete(server: RouterProcess | LoomServer, prompt: list[int],
              kv_transfer_params: dict | None = None):
    """The greedy text and its tokens' logprobs; with ``do_remote_decode`` in
    ``kv_transfer_params``, the prefill instance's kv_transfer_params instead."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json=body)
    assert response.status_code == 200, response.text
    if kv_transfer_params is not None and kv_transfer_params.get("do_remote_decode"):
        return response.json()["kv_transfer_params"]
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _assert_same(got: list[tuple[str, list[float]]], want: list[tuple[str, list[float]]]) -> None:
    for (text, logprobs), (want_text, want_logprobs) in zip(got, want, strict=True):
        assert text == want_text
        assert len(logprobs) == MAX_TOKENS and all(
            abs(a - b) < 1e-4 for a, b in zip(logprobs, want_logprobs, strict=True)), \
            (logprobs, want_logprobs)


def _wait_for_zero(server: LoomServer, name: str, timeout: float = 10.0) -> dict[str, float]:
    """Every replica's ``name`` once all are 0 (or, after ``timeout``, as they are); the
    metrics have no event to wait on (as LoomServer.wait_for_metric)."""
    deadline = time.monotonic() + timeout
    while True:
        values = server.metric_by_replica(name)
        if (values and not any(values.values())) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_prefill_and_decode_dp2_ep2_through_the_router_equal_one_rank(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    make_tiny_tokenizer(path)
    with open(os.path.join(path, "config.json")) as file:
        prompts = _prompts(json.load(file)["vocab_size"])
    want = _one_rank(path, prompts)

    servers, router = [], None
    try:
        with ThreadPoolExecutor(3) as pool:  # start all at once: mostly one import at a time
            servers = list(pool.map(lambda args: LoomServer(path, *args), (
                (*SERVER_ARGS, "--splitwise-role", "prefill"),
                (*SERVER_ARGS, "--splitwise-role", "decode"),
                (*PLAIN_ARGS, "--splitwise-role", "decode"))))
        prefill, decode, plain_decode = servers
        router = RouterProcess(args=("--prefill", prefill.url, "--decode", decode.url))
        router.wait_for_health(lambda body: body["status"] == "ok")
        # One at a time: a replica of each instance works, its peer joins every
        # all-to-all in dummy steps (on the decode side, also while the blocks arrive).
        _assert_same([_complete(router, prompt) for prompt in prompts], want)
        one_at_a_time = {side: server.metric_by_replica("vllm:request_success_total")
                         for side, server in (("prefill", prefill), ("decode", decode))}
        # All at once: both replicas of both instances busy.
        with ThreadPoolExecutor(len(prompts)) as pool:
            _assert_same(list(pool.map(lambda prompt: _complete(router, prompt), prompts)), want)
        for side, server in (("prefill", prefill), ("decode", decode)):
            served = server.metric_by_replica("vllm:request_success_total")
            assert sum(served.values()) == 2 * len(prompts), (side, served)
            # every replica took requests alone and among others
            assert all(one_at_a_time[side].get(r, 0) > 0 for r in "01"), (side, one_at_a_time)
            assert all(served[r] > one_at_a_time[side][r] for r in "01"), (side, served)
            # the prefill side freed every held block once sent, the decode side its own
            assert _wait_for_zero(server, "loom:kv_blocks_in_use") == {"0": 0.0, "1": 0.0}, side
            assert _wait_for_zero(server, "loom:engine_requests") == {"0": 0.0, "1": 0.0}, side
        # The experts' layout does not touch the KV cache's: a plain one-rank decode
        # instance takes the blocks of either prefill replica (each answer names the
        # rank of the replica that holds them).
        got, remote = [], set()
        for prompt in prompts:
            params = _complete(prefill, prompt, {"do_remote_decode": True})
            remote.add(tuple(params["remote_addresses"]))
            got.append(_complete(plain_decode, prompt, params))
        _assert_same(got, want)
        assert len(remote) == 2, remote
        assert plain_decode.wait_for_metric("loom:kv_blocks_in_use", 0) == 0
        assert _wait_for_zero(prefill, "loom:kv_blocks_in_use") == {"0": 0.0, "1": 0.0}
    finally:
        if router is not None:
            router.close()
        for server in servers:
            server.kill()
