from __future__ import annotations

import subprocess
import sys

import pytest

from loom.core.block_pool import BlockPool


def test_free_queue_order_and_middle_removal():
    pool = BlockPool(5)
    taken = pool.get_new_blocks(5)
    assert [b.block_id for b in taken] == [0, 1, 2, 3, 4]
    pool.free_blocks([taken[3], taken[1], taken[4]])
    assert [b.block_id for b in pool.free_queue] == [3, 1, 4]
    pool.cache_block(taken[0], 111)
    pool.free_blocks([taken[0]])
    pool.touch([pool.get_cached_block(111)])  # a cache hit pulls block 0 back out
    assert [b.block_id for b in pool.free_queue] == [3, 1, 4]
    assert pool.blocks[0].ref_cnt == 1
    pool.free_blocks([pool.blocks[0], taken[2]])
    assert pool.num_free_blocks == 5
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_reuse_evicts_hash_and_double_free_is_caught():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 7)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(7) is a
    (first,) = pool.get_new_blocks(1)
    assert first is a and pool.get_cached_block(7) is None and a.block_hash is None
    pool.free_blocks([first])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([first])


def test_asking_for_too_many_blocks_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_core_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import loom.core.scheduler, loom.core.wire"
    subprocess.run([sys.executable, "-c", code], check=True)
