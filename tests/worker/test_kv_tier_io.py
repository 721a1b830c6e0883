"""A rank's half of the KV offload tier (loom/worker/kv_tier_io.py) on hand-made caches:
a block saved and loaded into another comes back bit for bit (float32, bfloat16, int8
rows with their scales, a draft model's layers beside the target's); a record is taken
only for its own key and weights epoch; a write that fails leaves no record. Each in
files (the CPU's tier) and in host memory (a CUDA cache's, here unpinned)."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import torch

from loom.core.wire import KVTierCopy, KVTierOps
from loom.worker import kv_tier_io
from loom.worker.kv_tier_io import KVTierWorker

SLOTS, BLOCKS = 4, 6


def make_runner(dtype: torch.dtype, head_dim: int = 8, draft: bool = False):
    """The target's one allocation, (layer slots, K/V, heads, blocks, block size, head
    dim), filled with distinct values; a draft model's per-layer caches if asked."""
    shape = (3, 2, 2, BLOCKS, 4, head_dim)
    if dtype == torch.int8:
        storage = torch.randint(-128, 128, shape, dtype=torch.int8)
    else:
        storage = torch.randn(shape).to(dtype)
    proposer = None
    if draft:
        proposer = SimpleNamespace(kv_caches=[torch.randn(2, 1, BLOCKS, 4, 8) for _ in range(2)])
    return SimpleNamespace(kv_cache_storage=storage, draft_proposer=proposer)


def blocks_of(runner, block_id):
    caches = [runner.kv_cache_storage.select(3, block_id)]
    if runner.draft_proposer is not None:
        caches += [cache.select(2, block_id) for cache in runner.draft_proposer.kv_caches]
    return [cache.clone() for cache in caches]


@pytest.fixture(params=["files", "host memory"])
def where(request, tmp_path):
    """The tier's directory: files in tmp_path, or None for host memory."""
    return str(tmp_path) if request.param == "files" else None


@pytest.mark.parametrize("dtype,draft", [(torch.float32, False), (torch.bfloat16, True),
                                         (torch.int8, False)])
def test_a_block_comes_back_bit_for_bit(tmp_path, where, dtype, draft):
    runner = make_runner(dtype, head_dim=12 if dtype == torch.int8 else 8, draft=draft)
    tier = KVTierWorker(where, SLOTS, runner, model_name="m")
    kind = type(tier.slots).__name__
    assert kind == ("MappedFileSlots" if where else "HostMemorySlots")
    saved = blocks_of(runner, 1)
    assert tier.run(KVTierOps(saves=[KVTierCopy(1, 2, -77, 0)])) == []
    assert tier.run(KVTierOps(loads=[KVTierCopy(4, 2, -77, 0)])) == []
    for before, after in zip(saved, blocks_of(runner, 4)):
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))
    tier.close()
    assert os.listdir(tmp_path) == []


def test_a_record_is_taken_for_its_own_key_and_epoch_only(where):
    runner = make_runner(torch.float32)
    tier = KVTierWorker(where, SLOTS, runner)
    tier.run(KVTierOps(saves=[KVTierCopy(0, 1, 5, 0), KVTierCopy(2, 3, 6, 1)]))
    before = runner.kv_cache_storage.clone()
    loads = [KVTierCopy(5, 1, 5, 1),  # another group's key
             KVTierCopy(5, 1, 7, 0),  # another hash
             KVTierCopy(5, 0, 5, 0),  # a slot never written
             KVTierCopy(4, 3, 6, 1)]  # right
    assert tier.run(KVTierOps(loads=loads)) == [0, 1, 2]
    assert torch.equal(runner.kv_cache_storage[:, :, :, 5], before[:, :, :, 5])
    assert torch.equal(runner.kv_cache_storage[:, :, :, 4], before[:, :, :, 2])
    tier.invalidate()  # the weights changed
    assert tier.run(KVTierOps(loads=[KVTierCopy(4, 3, 6, 1)])) == [0]
    tier.close()


def test_a_write_that_fails_leaves_no_record(tmp_path, monkeypatch):
    runner = make_runner(torch.float32)
    tier = KVTierWorker(str(tmp_path), SLOTS, runner)
    tier.run(KVTierOps(saves=[KVTierCopy(0, 1, 5, 0)]))
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):
        if len(data) > kv_tier_io.TIER_RECORD_HEADER_BYTES:  # the payload
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(kv_tier_io.os, "pwrite", full_disk)
    tier.run(KVTierOps(saves=[KVTierCopy(3, 1, 9, 0)]))  # over slot 1: fails half way
    monkeypatch.setattr(kv_tier_io.os, "pwrite", real_pwrite)
    assert tier.run(KVTierOps(loads=[KVTierCopy(4, 1, 9, 0), KVTierCopy(4, 1, 5, 0)])) == [0, 1]
    tier.close()


def test_a_corrupted_record_in_host_memory_is_refused():
    runner = make_runner(torch.bfloat16)
    tier = KVTierWorker(None, SLOTS, runner)
    tier.run(KVTierOps(saves=[KVTierCopy(0, 2, 5, 0)]))
    tier.slots.payload(2)[7] ^= 0xFF  # a flipped byte
    before = runner.kv_cache_storage.clone()
    assert tier.run(KVTierOps(loads=[KVTierCopy(4, 2, 5, 0)])) == [0]
    assert torch.equal(runner.kv_cache_storage.view(torch.uint8), before.view(torch.uint8))
    tier.close()


def test_the_tier_of_a_cuda_cache_is_host_memory_unless_files_are_asked_for(tmp_path):
    from loom.config import CacheConfig

    assert CacheConfig(kv_offload_size=2**20).kv_offload_dir_on("cuda") is None
    assert CacheConfig(kv_offload_size=2**20).kv_offload_dir_on("cpu") is not None
    assert CacheConfig(kv_offload_size=2**20, kv_offload_path=str(tmp_path)).kv_offload_dir_on(
        "cuda") == str(tmp_path)


def test_a_host_memory_tier_larger_than_the_host_is_refused_at_start_up():
    from types import SimpleNamespace as NS

    from loom.config import CacheConfig
    from loom.config_checks import check_kv_offload

    hf_config = NS(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   hidden_size=64, head_dim=16)
    huge = CacheConfig(kv_offload_size=2**60)
    with pytest.raises(ValueError, match="pinned host memory"):
        check_kv_offload(hf_config, huge, "bfloat16", 1, "cuda")
    check_kv_offload(hf_config, CacheConfig(kv_offload_size=2**24), "bfloat16", 1, "cuda")
