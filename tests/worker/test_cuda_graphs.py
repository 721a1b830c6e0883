"""Decode steps as CUDA graphs replay them (worker/cuda_graphs.py), on the CPU.

A graph fixes shapes: the batch is padded to a bucket with copies of its first request,
the attention gathers a context bucket of positions, and the inputs go through static
buffers whose block table columns keep what earlier steps left. ``capture=False`` runs
exactly that padded step on those buffers eagerly, which any device can: greedy tokens
must equal the plain runner's, step after step, as the batch shrinks and the contexts
cross buckets. The capture itself needs a GPU (benchmarks/cuda_check.sh runs
tests/e2e/test_llm_correctness.py there with graphs on).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from checkpoints import make_tiny_checkpoint  # noqa: E402

from loom.engine_args import make_engine_config  # noqa: E402
from loom.core.wire import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from loom.sampling_params import SamplingParams  # noqa: E402
from loom.worker import cuda_graphs  # noqa: E402
from loom.worker.cuda_graphs import DecodeGraphs, batch_buckets, context_buckets  # noqa: E402
from loom.worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 8
BLOCKS_PER_REQ = 12  # 96 positions


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert context_buckets(2048, 16) == [256, 512, 1024, 2048]
    assert context_buckets(1000, 16) == [256, 512, 1008]  # whole blocks
    assert context_buckets(100, 16) == [112]


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    config = make_engine_config(path, dtype="float32", max_model_len=96, max_num_seqs=6,
                                block_size=BLOCK_SIZE, skip_tokenizer_init=True,
                                attention_backend="torch")
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(6 * BLOCKS_PER_REQ + 1)
    assert runner.cuda_graphs is None  # the CPU captures none
    return runner


def greedy(runner: ModelRunner, tag: str, prompts: list[list[int]],
           max_tokens: list[int]) -> list[list[int]]:
    """Prefill ``prompts`` together, then decode one token a step until each has
    ``max_tokens`` (the batch shrinks as requests finish); their outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max(max_tokens))
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    # blocks from the pool's end backwards: block ids, and their slots, differ by request
    blocks = {r: list(range(BLOCKS_PER_REQ * (i + 1), BLOCKS_PER_REQ * i, -1))
              for i, r in enumerate(ids)}
    tokens = {r: list(p) for r, p in zip(ids, prompts)}
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(
            req_id=r, prompt_token_ids=tokens[r], output_token_ids=[], sampling_params=params,
            eos_token_ids=[], block_ids=blocks[r], num_computed_tokens=0) for r in ids],
        scheduled_cached_reqs=[], num_scheduled_tokens={r: len(tokens[r]) for r in ids},
        total_num_scheduled_tokens=sum(map(len, prompts)), finished_req_ids=[]))
    outputs = {r: [] for r in ids}
    want = dict(zip(ids, max_tokens))
    while True:
        for r, sampled in zip(out.req_ids, out.sampled_token_ids):
            tokens[r] += sampled
            outputs[r] += sampled
        running = [r for r in ids if len(outputs[r]) < want[r]]
        finished = [r for r in out.req_ids if r not in running]
        if not running:
            runner.execute_model(SchedulerOutput(
                scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
                total_num_scheduled_tokens=0, finished_req_ids=finished))
            return [outputs[r] for r in ids]
        out = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[CachedRequestData(
                req_id=r, new_token_ids=tokens[r][-1:], new_block_ids=[],
                num_computed_tokens=len(tokens[r]) - 1) for r in running],
            num_scheduled_tokens={r: 1 for r in running},
            total_num_scheduled_tokens=len(running), finished_req_ids=finished))


def test_padded_static_decode_gives_the_plain_steps_tokens(runner, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)
    prompts = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)]
               for i, n in enumerate((5, 29, 11, 40, 2))]
    max_tokens = [40, 9, 25, 33, 52]  # contexts 45, 38, 36, 73, 54: over 3 buckets
    plain = greedy(runner, "plain", prompts, max_tokens)
    graphs = runner.cuda_graphs = DecodeGraphs(runner.model, 6, 96, BLOCK_SIZE,
                                               torch.device("cpu"), capture=False)
    assert graphs.batch_buckets == [1, 2, 4, 6] and graphs.context_buckets == [16, 32, 64, 96]
    try:
        replayed = greedy(runner, "replayed", prompts, max_tokens)
        # stale block table columns from a longer request, and the padding rows' writes,
        # must not change a later batch's tokens either
        again = greedy(runner, "again", prompts[2:4], max_tokens[2:4])
    finally:
        runner.cuda_graphs = None
    assert replayed == plain
    assert again == plain[2:4]
    # 5 requests padded to 6, then 4, 3 to 4, 2 and 1; the longest context crosses 64
    # at its 25th step, the second batch's at its 25th
    assert set(graphs.graphs) == {(6, 64), (4, 64), (4, 96), (2, 64), (1, 64), (1, 96)}
    assert graphs.replays == (max(max_tokens) - 1) + (max(max_tokens[2:4]) - 1)  # steps


def test_steps_graphs_do_not_take_run_eagerly(runner):
    graphs = DecodeGraphs(runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False)
    runner.cuda_graphs = graphs
    try:
        greedy(runner, "prefill-only", [[5, 6, 7]], [1])  # a prefill, then nothing
        assert graphs.replays == 0 and not graphs.graphs
        greedy(runner, "decode", [[5, 6, 7]], [3])
        assert graphs.replays == 2
        graphs.disabled = "a failed capture"
        greedy(runner, "disabled", [[5, 6, 7]], [3])
        assert graphs.replays == 2
    finally:
        runner.cuda_graphs = None


def test_a_failed_capture_keeps_graphs_off_when_the_cache_is_made_again(runner):
    """A capture that failed turned graphs off for the process: a new KV cache (wake_up
    after sleep) makes no new ones, and the reason is what the runner says."""
    graphs = DecodeGraphs(runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False)
    graphs.disabled = "RuntimeError: operation not permitted when stream is capturing"
    runner.cuda_graphs = graphs
    try:
        runner.initialize_kv_cache(6 * BLOCKS_PER_REQ + 1)
        assert runner.cuda_graphs is None
        assert runner._cuda_graphs_refusal() == (
            "off after a capture failed (RuntimeError: operation not permitted when "
            "stream is capturing)")
    finally:
        runner._graphs_failed = None
    assert runner._cuda_graphs_refusal() is None
    assert runner.cuda_graphs_memory_reserve() == 0  # the CPU captures none
