"""Blocks that every sliding-window layer has left behind go back to the pool early
(KVCacheManager with ``sliding_window``), and only those: the fake runner checks that
every position a step's queries read lies in a block the request still holds."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams

BLOCK_SIZE, WINDOW = 4, 10


def make_scheduler(num_blocks=64, budget=16, caching=True, window=WINDOW) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=512),
                     CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
                     num_blocks=num_blocks, sliding_window=window)


def make_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids={2})


def run(scheduler: Scheduler, requests: list[Request]) -> dict[str, int]:
    """Run to completion; the most blocks each request held at once."""
    for request in requests:
        scheduler.add_request(request)
    runner, peak = FakeRunner(), {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for req_id in out.num_scheduled_tokens:
            held = scheduler.kv_cache.num_blocks_held(req_id)
            peak[req_id] = max(peak.get(req_id, 0), held)
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert_empty(scheduler)
    return peak


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_outside_every_window_are_freed(caching):
    """A 70-token prompt in chunks of 16, then 30 decodes: the request never holds
    more blocks than its window and the step's new tokens span, against 25 without a
    window; the same with a second request sharing its first 40 tokens."""
    prompt = list(range(10, 80))
    shared = prompt[:40] + list(range(200, 230))
    scheduler = make_scheduler(caching=caching)
    peak = run(scheduler, [make_request("a", prompt, 30), make_request("b", shared, 30)])
    # A step computing positions c..c+n-1 holds blocks from (c - W + 1) // 4 to
    # (c + n - 1) // 4: at most (W - 1 + n - 1) // 4 + 2 = 8 blocks for n = 16.
    bound = (WINDOW - 1 + 16 - 1) // BLOCK_SIZE + 2
    assert all(n <= bound for n in peak.values()), peak
    assert scheduler.kv_cache.num_blocks_freed_early >= 2 * (100 // BLOCK_SIZE - bound)

    full = make_scheduler(caching=caching, window=None)
    peak_full = run(full, [make_request("a", prompt, 30), make_request("b", shared, 30)])
    assert peak_full == {"a": 25, "b": 25}
    assert full.kv_cache.num_blocks_freed_early == 0


def test_a_pool_too_small_for_full_contexts_serves_windowed_ones_without_preempting():
    """12 blocks hold 48 tokens: three 60-token requests would preempt each other
    without the window; with it they run side by side."""
    requests = [make_request(f"r{i}", list(range(10 + i, 50 + i)), 20) for i in range(3)]
    scheduler = make_scheduler(num_blocks=12, budget=8)
    run(scheduler, requests)
    assert scheduler.num_preemptions == 0
    requests = [make_request(f"r{i}", list(range(10 + i, 50 + i)), 20) for i in range(3)]
    full = make_scheduler(num_blocks=48, budget=8, window=None)
    peak_full = run(full, requests)
    assert sum(peak_full.values()) > 12


def test_freed_blocks_stay_cached_for_a_later_prefix_hit():
    """A freed full block keeps its hash: a later request with the same prefix hits it
    (the K/V in it is the prefix's, whatever happened to the request that wrote it)."""
    scheduler = make_scheduler()
    prompt = list(range(10, 60))
    run(scheduler, [make_request("a", prompt, 4)])
    manager = scheduler.kv_cache
    assert manager.num_blocks_freed_early > 0
    again = make_request("b", prompt + [7], 4)
    blocks, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 48 and len(blocks) == 12


def test_preempting_a_request_with_freed_blocks_frees_each_block_once():
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=False, sliding_window=WINDOW)
    request = make_request("a", list(range(10, 50)), 8)
    assert manager.allocate_slots(request, 40) is not None
    request.num_computed_tokens = 40
    assert manager.allocate_slots(request, 1) is not None  # keys from 31 on: blocks 0..6 go
    assert manager.get_block_ids("a")[:7] == [0] * 7
    assert manager.num_blocks_held("a") == 11 - 7
    assert manager.num_free_blocks == 16 - 4
    manager.free(request)  # a second free of blocks 0..6 would raise "double free"
    assert manager.num_free_blocks == 16


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        KVCacheManager(4, BLOCK_SIZE, sliding_window=0)
