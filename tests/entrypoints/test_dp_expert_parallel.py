"""``loom serve --data-parallel-size 2 --enable-expert-parallel``: each MoE layer's
experts split over both replicas' ranks (TP=1 each, so rank r of 2 holds half the
experts), tokens sent to their experts' rank and back by all-to-all, the replicas in
lock-step (an idle replica runs dummy steps).

Per family, the server's engine (``DPAsyncLLM``, in this process, two engine-core
processes and their workers) answers with transformers' greedy tokens (float32) and one
rank's: requests one at a time (the router takes turns, so one replica works while the
other takes part in every all-to-all with nothing of its own: without lock-step the
working one would wait in its first all-to-all until the step bound) and all at once
(both replicas work), with a step budget of 32 tokens (chunked prefill) and 10 KV blocks
(preemption), prefix caching on. A real ``loom serve`` with the same layout answers one
replica at a time, then loses a worker mid-stream: every replica's requests fail and
the server exits non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import httpx
import psutil
import pytest
import torch
from dp_greedy import one_then_all
from checkpoints import MOE_FAMILIES, bias_router, make_tiny_checkpoint
from loom_server import LoomServer, _spawned_children
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.async_llm import ControlError
from loom.engine_args import EngineArgs

MAX_TOKENS = 8
ENGINE = dict(data_parallel_size=2, enable_expert_parallel=True, dtype="float32",
              max_model_len=160, max_num_batched_tokens=32, num_gpu_blocks_override=10,
              max_num_seqs=8, watchdog_timeout_s=15.0)  # a lost lock-step: a hang in 15 s
SERVER_ARGS = ("--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32",
               "--max-model-len", "256", "--num-gpu-blocks-override", "64")


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab_size) for _ in range(40)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 5, 17, 70, 120, 100, 110, 130)]
    return prompts + [shared + [7], shared + [9, 10]]  # a prefix-cache hit


def _transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt):])
    return expected


async def _dp_greedy(path: str, prompts: list[list[int]]) -> tuple[list, list, list, str]:
    """Tokens one request at a time, then all at once; the replica of each request of
    the first pass; the metrics."""
    from loom.dp_async_llm import DPAsyncLLM

    config = EngineArgs(model=path, **ENGINE).create_engine_config()
    assert config.parallel.expert_parallel_size == 2
    llm = DPAsyncLLM(config, log_requests=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    await llm.start()
    try:
        one_at_a_time, all_at_once, replicas = await one_then_all(llm, prompts, params)
        # each replica holds part of every replica's experts: none may free or change them
        for method, kwargs in (("sleep", {"level": 2}), ("update_weights", {"path": path})):
            with pytest.raises(ControlError, match=f"{method} is not supported yet with "
                                                   "expert parallel across"):
                await llm.control(method, **kwargs)
        again, _, _ = await one_then_all(llm, prompts[:1], params, tag="after-")
        assert again == one_at_a_time[:1]
        return one_at_a_time, all_at_once, replicas, llm.metrics.render().decode()
    finally:
        await llm.shutdown()


def _metric_total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_dp2_ep2_matches_transformers_and_one_rank(tmp_path, family):
    path = make_tiny_checkpoint(family, tmp_path / family)
    make_tiny_tokenizer(path)
    with open(os.path.join(path, "config.json")) as file:
        prompts = _prompts(json.load(file)["vocab_size"])
    expected = _transformers_greedy(path, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=256) as llm:  # one rank, every expert
        one_rank = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert one_rank == expected

    one_at_a_time, all_at_once, replicas, metrics = asyncio.run(_dp_greedy(path, prompts))
    assert one_at_a_time == expected
    assert all_at_once == expected
    assert set(replicas) == {0, 1}, replicas  # each replica alone, the other in dummy steps
    # both passes, then the first prompt again alone and "all at once"
    assert _metric_total(metrics, "vllm:request_success_total") == 2 * len(prompts) + 2
    assert _metric_total(metrics, "vllm:num_preemptions_total") > 0, \
        "10 blocks were meant to force preemption"
    assert _metric_total(metrics, "vllm:prefix_cache_hits_total") > 0


async def _eplb_greedy(path: str, prompts: list[list[int]]) -> tuple[list, list]:
    """DP=2 x EP=2 with EPLB (2 redundant slots, a rearrangement every 4 steps): the
    tokens, all at once, and every rank's placement answer."""
    from loom.dp_async_llm import DPAsyncLLM

    config = EngineArgs(model=path, **ENGINE, enable_eplb=True, num_redundant_experts=2,
                        eplb_window_size=4).create_engine_config()
    llm = DPAsyncLLM(config, log_requests=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    await llm.start()
    try:
        async def run(request_id: str, prompt: list[int]) -> list[int]:
            async for output in llm.add_request(request_id, None, prompt, params,
                                                stream=False):
                last = output
            return list(last.outputs[0].token_ids)

        tokens = await asyncio.gather(*(run(f"r{i}", p) for i, p in enumerate(prompts)))
        return tokens, await llm.control("collective_rpc", method="eplb_placement")
    finally:
        await llm.shutdown()


def test_eplb_moves_busy_experts_and_keeps_transformers_tokens(tmp_path):
    """The router biased toward experts 1 and 2: EPLB gives both spare slots to them
    within the first windows (at first they copy experts 0 and 1), and the tokens stay
    transformers'."""
    path = bias_router(make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe"))
    make_tiny_tokenizer(path)
    prompts = _prompts(320)
    expected = _transformers_greedy(path, prompts)
    tokens, answers = asyncio.run(_eplb_greedy(path, prompts))
    assert tokens == expected
    ranks = [rank for replica in answers for rank in replica]
    assert len(ranks) == 2 and all(rank["rearranged"] > 0 for rank in ranks), ranks
    assert ranks[0]["placement"] == ranks[1]["placement"]  # planned alike everywhere
    for placement in ranks[0]["placement"]:  # each layer: 10 slots, 5 a rank
        # at first slots 8 and 9 copy experts 0 and 1; now both spare slots copy the
        # favoured ones
        assert placement.count(1) + placement.count(2) == 4, placement


def test_server_serves_one_replica_at_a_time_and_a_killed_worker_fails_it(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    make_tiny_tokenizer(path)
    server = LoomServer(path, *SERVER_ARGS)
    try:
        assert "expert parallel over 2 ranks of 2 data-parallel replicas" in server.output()
        # the router takes turns: each request runs on one replica, the other idle
        texts = [_complete_text(server, f"request {i}") for i in range(2)]
        assert texts == [_complete_text(server, f"request {i}") for i in range(2)]
        served = server.metric_by_replica("vllm:request_success_total")
        assert served == {"0": 2.0, "1": 2.0}, served
        _a_killed_worker_fails_every_replica(server)
    finally:
        server.kill()


def _complete_text(server: LoomServer, prompt: str) -> str:
    response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _a_killed_worker_fails_every_replica(server: LoomServer) -> None:
    """Replica 1's worker is SIGKILLed while both replicas decode long streams: every
    stream ends with an error (the dead replica's own, the other's aborted or failed in
    its all-to-all), /health turns 503 and the server exits non-zero."""
    cores = _spawned_children(psutil.Process(server.proc.pid))
    assert len(cores) == 2, cores
    workers = [_spawned_children(core) for core in cores]
    assert all(len(w) == 1 for w in workers), workers
    long_stream = {"max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0.0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions",
                               json={**long_stream, "prompt": [5 + i, 6, 7]})
                   for i in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]
        for line_iter in lines:
            assert next(line for line in line_iter if line).startswith("data: {")
        os.kill(workers[1][0].pid, signal.SIGKILL)
        endings = []
        for line_iter, stream in zip(lines, streams):
            events = [line for line in line_iter if line]
            assert events[-1] == "data: [DONE]"
            endings.append(json.loads(events[-2].removeprefix("data: ")))
            stream.__exit__(None, None, None)
    assert all("error" in ending for ending in endings), endings
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    assert server.proc.wait(60) != 0
