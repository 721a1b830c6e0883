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

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from checkpoints import SLIDING_WINDOW, make_tiny_checkpoint  # noqa: E402

from loom.distributed.parallel_state import SINGLE, TPGroup  # noqa: E402
from loom.engine_args import make_engine_config  # noqa: E402
from loom.model.attention.metadata import AttentionMetadata  # noqa: E402
from loom.model.layers import fused_moe  # noqa: E402
from loom.model.layers.fused_moe import dense_experts, expert_counts, fused_experts  # noqa: E402
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


def make_runner(family: str, path: Path, tp_group: TPGroup = SINGLE,
                attention_backend: str = "torch", **engine_args) -> ModelRunner:
    """A runner with room for 6 requests of BLOCKS_PER_REQ blocks in each KV cache group."""
    path = make_tiny_checkpoint(family, path)
    config = make_engine_config(path, dtype="float32", max_model_len=96, max_num_seqs=6,
                                block_size=BLOCK_SIZE, skip_tokenizer_init=True,
                                attention_backend=attention_backend, **engine_args)
    runner = ModelRunner(config, torch.device("cpu"), tp_group)
    runner.load_model()
    runner.initialize_kv_cache(len(runner.kv_cache_groups.windows) * 6 * BLOCKS_PER_REQ + 1)
    assert runner.cuda_graphs is None  # the CPU captures none
    return runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    return make_runner("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gemma3_runner(tmp_path_factory) -> ModelRunner:
    """Gemma 3's hybrid KV cache: of its 3 layers, one full-attention group and two
    sliding-window groups (SLIDING_WINDOW, 12 tokens), each with block tables of its own."""
    runner = make_runner("gemma3", tmp_path_factory.mktemp("gemma3"))
    assert runner.kv_cache_groups.windows == (None, SLIDING_WINDOW, SLIDING_WINDOW)
    return runner


def blocks_of(i: int, group: int) -> list[int]:
    """Request ``i``'s blocks in KV cache group ``group``, from the pool's end backwards:
    block ids, and their slots, differ by request and by group (group g's are
    g * 6 * BLOCKS_PER_REQ further on)."""
    first = (6 * group + i) * BLOCKS_PER_REQ
    return list(range(first + BLOCKS_PER_REQ, first, -1))


def greedy(runner: ModelRunner, tag: str, prompts: list[list[int]],
           max_tokens: list[int], expert_tokens: list | None = None) -> list[list[int]]:
    """Prefill ``prompts`` together, then decode one token a step until each has
    ``max_tokens`` (the batch shrinks as requests finish); their outputs. Each step's
    ``expert_tokens`` (an MoE model's routing counts) go to ``expert_tokens`` if given."""
    params = SamplingParams(temperature=0.0, max_tokens=max(max_tokens))
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    num_groups = len(runner.kv_cache_groups.windows)
    blocks = {r: blocks_of(i, 0) for i, r in enumerate(ids)}
    group_blocks = {r: [blocks_of(i, g) for g in range(1, num_groups)]
                    for i, r in enumerate(ids)}
    tokens = {r: list(p) for r, p in zip(ids, prompts)}
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(
            req_id=r, prompt_token_ids=tokens[r], output_token_ids=[], sampling_params=params,
            eos_token_ids=[], block_ids=blocks[r], num_computed_tokens=0,
            group_block_ids=group_blocks[r]) for r in ids],
        scheduled_cached_reqs=[], num_scheduled_tokens={r: len(tokens[r]) for r in ids},
        total_num_scheduled_tokens=sum(map(len, prompts)), finished_req_ids=[]))
    outputs = {r: [] for r in ids}
    want = dict(zip(ids, max_tokens))
    while True:
        if expert_tokens is not None:
            expert_tokens.append(out.expert_tokens)
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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_padded_static_decode_gives_the_plain_steps_tokens(family, request, monkeypatch):
    """Gemma 3 (a hybrid KV cache): its sliding-window group goes through static slots
    and block tables of its own, and its contexts (up to 73) run far past the window."""
    runner = request.getfixturevalue("runner" if family == "llama" else "gemma3_runner")
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)
    prompts = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)]
               for i, n in enumerate((5, 29, 11, 40, 2))]
    max_tokens = [40, 9, 25, 33, 52]  # contexts 45, 38, 36, 73, 54: over 3 buckets
    plain = greedy(runner, "plain", prompts, max_tokens)
    graphs = runner.cuda_graphs = DecodeGraphs(
        runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False,
        num_kv_cache_groups=len(runner.kv_cache_groups.windows))
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
    assert set(graphs.graphs) == {(6, 64, 1), (4, 64, 1), (4, 96, 1), (2, 64, 1), (1, 64, 1),
                                  (1, 96, 1)}
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


def test_a_step_with_lora_slots_runs_eagerly(runner):
    """A graph's metadata carries no adapter slots: a step of an engine with LoRA on
    (its slots set, -1 for the base) must not replay one, or its adapters would be
    left out."""
    graphs = DecodeGraphs(runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False)
    metadata = AttentionMetadata.from_numpy(
        np.array([9]), np.array([0, 1]), np.array([10]),
        np.array([[1, 2]]), BLOCK_SIZE, torch.device("cpu"))
    assert graphs.buckets_for(metadata) == (1, 96, 1)
    metadata.lora_slots = torch.tensor([0])
    assert graphs.buckets_for(metadata) is None


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


@pytest.mark.parametrize("family,quantization", [("qwen3_moe", "none"), ("mixtral", "none"),
                                                 ("qwen3_moe", "wint8")])
def test_moe_padded_static_decode_gives_the_plain_steps_tokens_and_counts(
        family, quantization, tmp_path, monkeypatch):
    """An MoE model's padded static step runs its experts in fixed shapes
    (``dense_experts``: every expert on every row, each row keeping its top-k's): the
    greedy tokens are the plain runner's, and so are each step's routing counts, the
    padding rows not counted."""
    runner = make_runner(family, tmp_path, quantization=quantization)
    assert runner._cuda_graphs_refusal() is None
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)
    prompts = [[(5 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((7, 19, 3))]
    max_tokens = [12, 5, 20]  # 3 requests padded to 4, then 2, then 1; contexts cross 16
    plain_counts, replayed_counts = [], []
    plain = greedy(runner, "plain", prompts, max_tokens, plain_counts)
    dense_calls = []

    def counted(*args, **kwargs):
        dense_calls.append(args[0].shape[0])
        return dense_experts(*args, **kwargs)
    monkeypatch.setattr(fused_moe, "dense_experts", counted)
    graphs = runner.cuda_graphs = DecodeGraphs(runner.model, 6, 96, BLOCK_SIZE,
                                               torch.device("cpu"), capture=False)
    try:
        replayed = greedy(runner, "replayed", prompts, max_tokens, replayed_counts)
    finally:
        runner.cuda_graphs = None
    assert replayed == plain
    assert replayed_counts == plain_counts
    top_k = runner.moe_layers[0].spec.top_k
    assert [sum(c) for c in plain_counts[1:]] == [  # decode steps: real rows only
        len(runner.moe_layers) * top_k * sum(len(o) > s for o in plain)
        for s in range(1, max(max_tokens))]
    steps = max(max_tokens) - 1
    assert graphs.replays == steps
    assert len(dense_calls) == steps * len(runner.moe_layers)
    assert set(dense_calls) == {4, 2, 1}  # the padded batches
    assert all(layer.graph_rows is None for layer in runner.moe_layers)
    # experts spread over ranks stay eager: the all-to-all reads counts on the host
    monkeypatch.setattr(runner.moe_layers[0], "expert_parallel", SimpleNamespace(size=2))
    assert runner._cuda_graphs_refusal().startswith("off under expert parallel")


def test_dense_experts_equal_the_grouped_ones():
    """``dense_experts`` against ``fused_experts``, on a rank's part of the experts
    too, and the counts of the rows a mask keeps."""
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    w13, w2 = torch.randn(6, 24, 16), torch.randn(6, 16, 12)
    weights = torch.rand(5, 2)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(5)])
    for start, end in ((0, 6), (2, 5)):
        grouped = fused_experts(x, w13[start:end], w2[start:end], weights, ids, start)
        dense = dense_experts(x, w13[start:end], w2[start:end], weights, ids, start)
        torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-5)
    rows = torch.tensor([1, 1, 1, 0, 0])
    assert expert_counts(ids, 6, rows).tolist() == torch.bincount(
        ids[:3].flatten(), minlength=6).tolist()
    assert expert_counts(ids, 6).tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()


def spec_greedy(runner: ModelRunner, tag: str, prompts: list[list[int]], drafts_of,
                draft_counts: list[list[int]]) -> list[list[int]]:
    """Prefill ``prompts``, then run verification steps: each request its last token and
    ``drafts_of(step, i, outputs)``'s drafts (the drafter's place), greedy, each step's
    accepted drafts and one more token kept; ``drafts_of`` returning None drops the
    request. The outputs, per request; each step's draft counts go to ``draft_counts``."""
    params = SamplingParams(temperature=0.0, max_tokens=96)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    num_groups = len(runner.kv_cache_groups.windows)
    tokens = {r: list(p) for r, p in zip(ids, prompts)}
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(
            req_id=r, prompt_token_ids=tokens[r], output_token_ids=[], sampling_params=params,
            eos_token_ids=[], num_computed_tokens=0, block_ids=blocks_of(i, 0),
            group_block_ids=[blocks_of(i, g) for g in range(1, num_groups)])
            for i, r in enumerate(ids)],
        scheduled_cached_reqs=[], num_scheduled_tokens={r: len(tokens[r]) for r in ids},
        total_num_scheduled_tokens=sum(map(len, prompts)), finished_req_ids=[]))
    outputs = {r: [] for r in ids}
    finished: list[str] = []
    for step in range(100):
        for r, sampled in zip(out.req_ids, out.sampled_token_ids):
            tokens[r] += sampled
            outputs[r] += sampled
        drafts = {r: drafts_of(step, i, outputs[r]) for i, r in enumerate(ids)
                  if r not in finished}
        finished = [r for r, d in drafts.items() if d is None]
        running = [r for r, d in drafts.items() if d is not None]
        if not running:
            break
        draft_counts.append([len(drafts[r]) for r in running])
        out = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[CachedRequestData(
                req_id=r, new_token_ids=list(sampled), new_block_ids=[],
                num_computed_tokens=len(tokens[r]) - 1)
                for r, sampled in zip(out.req_ids, out.sampled_token_ids) if r in running],
            num_scheduled_tokens={r: 1 + len(drafts[r]) for r in running},
            total_num_scheduled_tokens=sum(1 + len(drafts[r]) for r in running),
            finished_req_ids=finished, scheduled_spec_decode_tokens={
                r: drafts[r] for r in running if drafts[r]}))
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
        total_num_scheduled_tokens=0, finished_req_ids=finished))
    return [outputs[r] for r in ids]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("family,backend", [
    ("llama", "torch"), ("gemma3", "torch"),
    pytest.param("llama", "triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="Triton's kernels on the CPU: TRITON_INTERPRET=1 "
        "(test_verification_and_mixed_steps_on_the_triton_kernels_under_the_interpreter)"))])
def test_padded_static_verification_steps_give_the_plain_steps_tokens(
        family, backend, tmp_path, monkeypatch):
    """Speculative decoding's verification steps (every request its last token and k
    drafts) replay per (batch, context, k + 1): the padded static step, its attention
    batched over the cache with each query's causal (and sliding-window) mask, gives the
    plain runner's greedy tokens, drafts accepted in part, in whole and not at all, as
    the batch shrinks and contexts cross buckets (Gemma 3's past its window of 12); a
    step whose requests have different numbers of drafts runs eagerly."""
    runner = make_runner(family, tmp_path, attention_backend=backend, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)
    prompts = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 21, 9))]
    reference = greedy(runner, "reference", prompts, [40, 40, 40])

    def drafts_of(step: int, i: int, outputs: list[int]) -> list[int] | None:
        if len(outputs) >= 30 - 8 * i:  # requests 2, then 1, then 0 finish
            return None
        right = reference[i][len(outputs):len(outputs) + 2]
        if step == 3 and i == 1:
            return right[:1]  # fewer drafts than the others: the step runs eagerly
        return [right[0], 3] if (step + i) % 3 == 1 else right  # one wrong, or both right

    plain = spec_greedy(runner, "plain", prompts, drafts_of, [])
    graphs = runner.cuda_graphs = DecodeGraphs(
        runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False,
        num_kv_cache_groups=len(runner.kv_cache_groups.windows),
        max_query_len=runner._graph_query_len)
    staged = []
    stage = graphs._stage

    def stage_checked(n: int, batch: int, query_len: int, *args) -> None:
        """Padding requests repeat request 0's tokens, positions and slots (its K/V
        written again to the same slots), not what an earlier step left there."""
        stage(n, batch, query_len, *args)
        for buffer in (graphs.inputs.input_ids, graphs.inputs.positions,
                       graphs.inputs.slot_mapping):
            requests = buffer[:batch * query_len].view(batch, query_len)
            assert torch.equal(requests[n:], requests[:1].expand(batch - n, -1))
        staged.append((n, batch, query_len))
    graphs._stage = stage_checked
    try:
        draft_counts = []
        replayed = spec_greedy(runner, "replayed", prompts, drafts_of, draft_counts)
    finally:
        runner.cuda_graphs = None
    assert replayed == plain
    assert all(p == r[:len(p)] for p, r in zip(plain, reference))
    assert {bucket[2] for bucket in graphs.graphs} == {3}
    assert {bucket[0] for bucket in graphs.graphs} == {4, 2, 1}  # 3 padded to 4, 2, 1
    assert len({bucket[1] for bucket in graphs.graphs}) >= 2  # contexts over buckets
    assert (3, 4, 3) in staged
    assert [2, 1, 2] in draft_counts  # the uneven step ran, eagerly
    assert graphs.replays == sum(set(counts) == {2} for counts in draft_counts)


def chunked_greedy(runner: ModelRunner, tag: str, prompts: list[list[int]], starts: list[int],
                   chunk: int, max_tokens: int) -> list[list[int]]:
    """Request i arrives at step ``starts[i]`` and is prefilled ``chunk`` tokens a step,
    beside the others' decodes and chunks (mixed steps), then decodes until it has
    ``max_tokens``; greedy. The outputs, per request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens = {r: list(p) for r, p in zip(ids, prompts)}
    computed = {r: 0 for r in ids}
    outputs = {r: [] for r in ids}
    unsent = {r: [] for r in ids}  # sampled tokens the runner has not been sent yet
    finished: list[str] = []
    for step in range(200):
        running = [r for i, r in enumerate(ids)
                   if starts[i] <= step and len(outputs[r]) < max_tokens]
        if not running:
            break
        scheduled = {r: min(chunk, len(tokens[r]) - computed[r]) for r in running}
        new = [NewRequestData(req_id=r, prompt_token_ids=tokens[r], output_token_ids=[],
                              sampling_params=params, eos_token_ids=[],
                              block_ids=blocks_of(ids.index(r), 0), num_computed_tokens=0)
               for r in running if computed[r] == 0]
        cached = [CachedRequestData(req_id=r, new_token_ids=unsent[r], new_block_ids=[],
                                    num_computed_tokens=computed[r])
                  for r in running if computed[r] > 0]
        out = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=finished))
        for r in running:
            computed[r] += scheduled[r]
            unsent[r] = []
        for r, sampled in zip(out.req_ids, out.sampled_token_ids):
            tokens[r] += sampled
            outputs[r] += sampled
            unsent[r] = list(sampled)
        finished = [r for r in running if len(outputs[r]) >= max_tokens]
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
        total_num_scheduled_tokens=0, finished_req_ids=finished))
    return [outputs[r] for r in ids]


@pytest.mark.skipif(not INTERPRETED, reason="Triton's kernels on the CPU: TRITON_INTERPRET=1 "
                    "(test_verification_and_mixed_steps_on_the_triton_kernels_under_the_"
                    "interpreter)")
def test_padded_static_mixed_steps_give_the_plain_steps_tokens(tmp_path, monkeypatch):
    """On the Triton backend, steps mixing prefill chunks with decodes replay per token
    bucket: padded with one-token requests that repeat the step's last token (its K/V
    written again to its slot), the padded static step gives the plain runner's greedy
    tokens; pure decode steps keep their own graphs."""
    runner = make_runner("llama", tmp_path, attention_backend="triton")
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)
    monkeypatch.setattr(cuda_graphs, "MIN_MIXED_TOKENS", 4)
    prompts = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 30, 17))]
    starts, chunk = [0, 2, 5], 8
    plain = chunked_greedy(runner, "plain", prompts, starts, chunk, 12)
    graphs = runner.cuda_graphs = DecodeGraphs(
        runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False,
        max_mixed_tokens=32)
    assert graphs.mixed_buckets == [4, 8, 16, 32]
    try:
        replayed = chunked_greedy(runner, "replayed", prompts, starts, chunk, 12)
    finally:
        runner.cuda_graphs = None
    assert replayed == plain
    assert set(graphs.mixed_graphs) == {8, 16}  # 5 and 8 + 1 tokens; 8 + 2, 9 + 2
    assert graphs.graphs  # the decode steps between


@pytest.mark.skipif(INTERPRETED, reason="this process runs the Triton case itself")
def test_verification_and_mixed_steps_on_the_triton_kernels_under_the_interpreter():
    """The Triton backend in a captured verification or mixed step reads the step's
    lengths and query starts as tensors and takes the buckets' maxima for its launch:
    the padded static steps give the plain runner's tokens on its kernels too,
    interpreted on the CPU in a fresh process (Triton reads TRITON_INTERPRET when it
    decorates a kernel)."""
    environ = dict(os.environ, TRITON_INTERPRET="1", LOOM_NATIVE_KERNELS="0")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "steps_give and (triton or mixed)"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
        timeout=600, env=environ)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
