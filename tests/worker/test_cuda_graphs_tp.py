"""Decode graphs under tensor parallel, on the CPU: two gloo ranks of a tiny Gemma 3 (a
hybrid KV cache as well) run the padded static steps (``capture=False``) in lockstep and
give the plain runner's greedy tokens; a capture that fails on one rank turns graphs off
on both, at the same step (worker/cuda_graphs.py, ``DecodeGraphs._capture``). NCCL inside
a captured graph needs a GPU: not run here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.distributed.parallel_state import TPGroup
from loom.worker import cuda_graphs
from loom.worker.cuda_graphs import DecodeGraphs

from .test_cuda_graphs import BLOCK_SIZE, greedy, make_runner, make_tiny_checkpoint

PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((5, 9, 11))]
MAX_TOKENS = [20, 6, 14]  # 3 requests padded to 4, then 2, then 1; contexts 6 to 25


class RankZeroSamples:
    """The runner as the engine drives a rank: every rank gets rank 0's sampled tokens
    (only rank 0 samples; the scheduler sends them to all)."""

    def __init__(self, runner) -> None:
        self.runner, self.kv_cache_groups = runner, runner.kv_cache_groups

    def execute_model(self, step):
        out = self.runner.execute_model(step)
        sampled = [out.sampled_token_ids]
        dist.broadcast_object_list(sampled, src=0)
        out.sampled_token_ids = sampled[0]
        return out


def _run(runner, tag: str, fail_on_rank: int | None = None):
    """Greedy tokens with decode graphs (capture=False) over the TP group; a capture on
    rank ``fail_on_rank`` raises. The tokens, the graphs' buckets, replays, why off."""
    tp_group = runner.runner.tp_group
    graphs = runner.runner.cuda_graphs = DecodeGraphs(
        runner.runner.model, 6, 96, BLOCK_SIZE, torch.device("cpu"), capture=False,
        num_kv_cache_groups=len(runner.kv_cache_groups.windows), tp_group=tp_group)
    if tp_group.rank == fail_on_rank:
        def fail(forward):
            raise RuntimeError("operation not permitted when stream is capturing")
        graphs._record = fail
    try:
        tokens = greedy(runner, tag, PROMPTS, MAX_TOKENS)
    finally:
        runner.runner.cuda_graphs = None
    return tokens, sorted(graphs.graphs), graphs.replays, graphs.disabled


def _worker(rank: int, store_path: str, tmp_path: str) -> None:
    torch.set_num_threads(1)
    # built before the group exists: transformers saves only on rank 0 of one
    make_tiny_checkpoint("gemma3", os.path.join(tmp_path, "built"))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)
    try:
        cuda_graphs.MIN_CONTEXT = 16
        # the agreement goes over a host group of its own, as beside NCCL on CUDA
        tp_group = TPGroup(rank, 2, dist.group.WORLD, host_group=dist.new_group(backend="gloo"))
        runner = RankZeroSamples(make_runner(
            "gemma3", os.path.join(tmp_path, f"rank{rank}"), tp_group))
        plain = greedy(runner, "plain", PROMPTS, MAX_TOKENS)
        results = {"plain": plain, "replayed": _run(runner, "replayed"),
                   "failed": _run(runner, "failed", fail_on_rank=1)}
        torch.save(results, os.path.join(tmp_path, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel.py: no C++ static destructors after gloo


def test_tp2_ranks_replay_alike_and_go_eager_together(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    plain = ranks[0]["plain"]
    steps = max(MAX_TOKENS) - 1
    for rank in ranks:
        tokens, buckets, replays, disabled = rank["replayed"]
        assert tokens == plain and disabled is None and replays == steps
        assert buckets == [(1, 32, 1), (2, 32, 1), (4, 16, 1)]
        # rank 1's first capture failed: both ranks off from that step, every step eager
        tokens, buckets, replays, disabled = rank["failed"]
        assert tokens == plain and buckets == [] and replays == 0
    assert ranks[0]["failed"][3] == "a capture failed on another tensor-parallel rank"
    assert ranks[1]["failed"][3] == (
        "RuntimeError: operation not permitted when stream is capturing")
