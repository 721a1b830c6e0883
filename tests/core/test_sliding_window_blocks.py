"""Blocks that every sliding-window layer has left behind go back to the pool early
(KVCacheManager with ``sliding_window``, or a hybrid cache's sliding groups), and only
those: the fake runner checks that every position a step's queries read lies in a block
the request still holds, in each group."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams

BLOCK_SIZE, WINDOW = 4, 10


def make_scheduler(num_blocks=64, budget=16, caching=True, window=WINDOW,
                   groups=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=512),
                     CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
                     num_blocks=num_blocks, kv_cache_groups=groups or (window,))


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
    (blocks,), num_hit = manager.get_computed_blocks(again)
    # the hit takes only the blocks the first query to come reads (positions 39..)
    assert num_hit == 48 and len(blocks) == 12
    assert blocks[:9] == [None] * 9 and None not in blocks[9:]


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


# Gemma 3's layout: one group of global layers, two of local ones (window W).
HYBRID = (None, WINDOW, WINDOW)


def test_hybrid_cache_frees_sliding_blocks_and_keeps_full_ones():
    """One step at a time: a sliding group's blocks go once no window reads them; the
    full group's stay; preemption and the end free each block once."""
    manager = KVCacheManager(64, BLOCK_SIZE, enable_caching=False, group_windows=HYBRID)
    request = make_request("a", list(range(10, 50)), 8)
    assert len(manager.allocate_slots(request, 40)) == 3 * 10
    request.num_computed_tokens = 40
    manager.allocate_slots(request, 1)  # the next query reads keys 31..40: blocks 7..10
    full, local, other = manager.req_to_blocks["a"]
    assert None not in full and len(full) == 11
    assert local[:7] == [None] * 7 and None not in local[7:]
    assert other[:7] == [None] * 7 and None not in other[7:]
    assert manager.get_block_ids("a", 1)[:7] == [0] * 7
    assert manager.num_blocks_held("a") == 11 + 2 * 4
    assert manager.num_blocks_freed_early == 2 * 7
    assert manager.num_free_blocks == 64 - 19
    manager.free(request)
    assert manager.num_free_blocks == 64


@pytest.mark.parametrize("caching", [True, False])
def test_hybrid_scheduler_runs_chunks_decodes_and_shared_prefixes(caching):
    """Mixed prompts, chunked by 16, with a shared 40-token prefix: every query's
    window is held in each sliding group, every position in the full group; the
    sliding groups hold at most the window and a chunk, the full group everything."""
    prompt = list(range(10, 80))
    shared = prompt[:40] + list(range(200, 230))
    scheduler = make_scheduler(caching=caching, groups=HYBRID, num_blocks=128)
    requests = [make_request("a", prompt, 30), make_request("b", shared, 30),
                make_request("c", list(range(300, 305)), 6)]
    peak = {}
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for req_id in out.num_scheduled_tokens:
            groups = scheduler.kv_cache.req_to_blocks[req_id]
            held = [sum(block is not None for block in blocks) for blocks in groups]
            peak[req_id] = [max(a, b) for a, b in zip(peak.get(req_id, held), held)]
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert_empty(scheduler)
    bound = (WINDOW - 1 + 16 - 1) // BLOCK_SIZE + 2
    assert peak["a"][0] == peak["b"][0] == 25 and peak["c"] == [3, 3, 3]
    assert all(n <= bound for req_id in "ab" for n in peak[req_id][1:]), peak
    if caching:
        assert scheduler.prefix_cache_hits == 40


def test_hybrid_prefix_hit_needs_only_the_window_blocks_of_sliding_groups():
    """A cached prompt of 12 blocks, asked for again with one more token: a hit of 12
    blocks needs all of the full group's but, in each sliding group, only those the
    query at 48 reads (keys 39..: blocks 9..11). A sliding block before them missing
    changes nothing; one among them shortens the hit to where the window is whole."""
    manager = KVCacheManager(128, BLOCK_SIZE, group_windows=HYBRID)
    prompt = list(range(10, 58))
    first = make_request("a", prompt, 4)
    manager.allocate_slots(first, 48)
    manager.free(first)
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt + [7], 4))
    assert num_hit == 48 and [len(group) for group in hits] == [12, 12, 12]
    assert hits[1][:9] == [None] * 9 and None not in hits[1][9:] + hits[0]
    pool = manager.pool
    # evict group 2's block 3 (outside the window): the hit stays whole
    pool._evict(pool.cached[(first.block_hashes[3], 2)])
    hits, num_hit = manager.get_computed_blocks(make_request("c", prompt + [7], 4))
    assert num_hit == 48
    # evict group 1's block 10 (inside it): the longest hit whose window is whole ends
    # before it (10 blocks: the query at 40 reads 31..39, blocks 7..9)
    pool._evict(pool.cached[(first.block_hashes[10], 1)])
    hits, num_hit = manager.get_computed_blocks(make_request("d", prompt + [7], 4))
    assert num_hit == 40 and [len(group) for group in hits] == [10, 10, 10]
    assert hits[1][:7] == [None] * 7 and None not in hits[1][7:]
    # the full group's block 2 missing: nothing past it is a hit
    pool._evict(pool.cached[first.block_hashes[2]])
    hits, num_hit = manager.get_computed_blocks(make_request("e", prompt + [7], 4))
    assert num_hit == 8


def test_hybrid_pool_serves_more_sequences_than_one_table():
    """Three 60-token requests over 3 groups: 81 blocks hold each one's 15 in the
    full group and at most 6 in each sliding one (window 10, chunks of 8), so they
    run side by side; as three full groups (every layer keeping every position, 45
    blocks each) they preempt each other."""
    def requests():
        return [make_request(f"r{i}", list(range(10 + i, 50 + i)), 20) for i in range(3)]
    scheduler = make_scheduler(num_blocks=3 * 15 + 3 * 2 * 6, budget=8, groups=HYBRID)
    run(scheduler, requests())
    assert scheduler.num_preemptions == 0
    full = make_scheduler(num_blocks=3 * 15 + 3 * 2 * 6, budget=8,
                          groups=(None, None, None))
    run(full, requests())
    assert full.num_preemptions > 0


def test_a_prefix_hit_never_puts_one_block_in_two_groups():
    """Found in review: with one group's new blocks taken from the free queue before the
    next group's idle hits left it, a hit could be handed out again as a new block, and
    one block sat in two groups' tables (layer i of every group shares slot i: one
    group's K/V over the other's). R (12 tokens) and Q (24) freed, in that order, put
    both groups' blocks side by side in the queue; S, R's prompt and 6 more tokens, hits
    R's blocks and needs new ones."""
    manager = KVCacheManager(18, BLOCK_SIZE, group_windows=(None, 8))
    r = make_request("r", list(range(10, 22)), 4)
    q = make_request("q", list(range(100, 124)), 4)
    assert manager.allocate_slots(r, 12) is not None
    assert manager.allocate_slots(q, 24) is not None
    manager.free(r)
    manager.free(q)
    s = make_request("s", list(range(10, 22)) + list(range(200, 206)), 4)
    hits, num_hit = manager.get_computed_blocks(s)
    assert num_hit == 12
    assert manager.allocate_slots(s, 6, hits) is not None
    held = [block for group in manager.req_to_blocks["s"] for block in group
            if block is not None]
    assert len({block.block_id for block in held}) == len(held), \
        [[b and b.block_id for b in group] for group in manager.req_to_blocks["s"]]
    assert all(block.ref_cnt == 1 for block in held)
