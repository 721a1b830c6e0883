"""TP=2 for real (two processes, gloo) gives the logits of TP=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.distributed.parallel_state import TPGroup
from loom.model.loader import load_hf_config, load_model

from .checkpoints import make_tiny_checkpoint
from .test_models import run_scenario

# qwen2: qkv bias; qwen3: 2 KV heads split over 2 ranks; llama_tied_rope3: tied,
# vocab-parallel embedding and LM head; gemma3, ernie4_5, mistral_sliding: sliding
# windows, sandwich norms, rope pairs reordered before the split (the MoE families:
# test_moe.py). Checked in one spawn to keep startup cost once.
TP_FAMILIES = ("qwen2", "qwen3", "llama_tied_rope3", "gemma3", "ernie4_5", "mistral_sliding")


def _scenario_logits(path: str, tp_group: TPGroup) -> list[torch.Tensor]:
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.float32, tp_group=tp_group)
    return [logits for _, logits, _ in run_scenario(model, config.vocab_size)]


def _worker(rank: int, world_size: int, store_path: str, paths: list[str],
            out_path: str) -> None:
    torch.set_num_threads(1)
    # A file store, not TCP: with TCP, rank 0 hosts the store, and its exit could race
    # rank 1's teardown (seen once as std::terminate / SIGABRT in rank 1).
    dist.init_process_group("gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world_size)
    try:
        group = TPGroup(rank, world_size, dist.group.WORLD)
        results = {path: _scenario_logits(path, group) for path in paths}
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave as loom's worker processes do (worker_process.py): without running C++
    # static destructors at interpreter exit, where a still-joinable gloo thread has
    # been seen to std::terminate this rank (SIGABRT, about 1 run in 15).
    os._exit(0)


def test_tp2_matches_tp1(tmp_path):
    paths = [make_tiny_checkpoint(f, tmp_path / f) for f in TP_FAMILIES]
    out_path = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), paths, out_path), nprocs=2, join=True)
    tp2 = torch.load(out_path)
    for path in paths:
        tp1 = _scenario_logits(path, TPGroup())
        assert len(tp1) == len(tp2[path])
        for a, b in zip(tp1, tp2[path]):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_kv_heads_replicated_when_tp_exceeds_them():
    """tp=4 over 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1."""
    from loom.model.layers.linear import QKVParallelLinear

    q, k, v = torch.randn(16, 3), torch.randn(8, 3), torch.randn(8, 3)
    for rank in range(4):
        layer = QKVParallelLinear(3, 4, 4, 2, tp_group=TPGroup(rank, 4, None))
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, shard_id)
        kv_head = rank // 2
        torch.testing.assert_close(layer.weight[:4], q[rank * 4:(rank + 1) * 4])
        torch.testing.assert_close(layer.weight[4:8], k[kv_head * 4:(kv_head + 1) * 4])
        torch.testing.assert_close(layer.weight[8:], v[kv_head * 4:(kv_head + 1) * 4])
    with pytest.raises(ValueError, match="not a multiple"):
        QKVParallelLinear(3, 4, 6, 2, tp_group=TPGroup(0, 3, None))
