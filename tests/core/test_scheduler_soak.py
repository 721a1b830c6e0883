"""Thousands of random add / abort / step events: no leak, no negative ref count, no starvation."""

from __future__ import annotations

import random

from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams


def test_random_soak():
    rng = random.Random(1234)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32,
                                          max_model_len=96),
                          CacheConfig(block_size=4), num_blocks=30)
    runner = FakeRunner(next_token=lambda req_id, n: (hash(req_id) + n) % 50)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    added_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    next_id = 0
    for step in range(4000):
        event = rng.random()
        if event < 0.25 and step < 3500:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.5)
            req_id = f"r{next_id}"
            next_id += 1
            scheduler.add_request(Request(req_id, prompt, params, eos_token_ids={0}))
            added_at[req_id] = step
        elif event < 0.30 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests(victim)
            finished_at[victim] = step
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            if o.finished:
                finished_at[o.req_id] = step
        pool = scheduler.kv_cache.pool
        assert all(block.ref_cnt >= 0 for block in pool.blocks)
        in_use = sum(1 for block in pool.blocks if block.ref_cnt > 0)
        assert in_use + pool.num_free_blocks == pool.num_blocks
        owned = {b.block_id for groups in scheduler.kv_cache.req_to_blocks.values()
                 for blocks in groups for b in blocks if b is not None}
        assert owned == {b.block_id for b in pool.blocks if b.ref_cnt > 0}
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            if o.finished:
                finished_at[o.req_id] = 4000
    assert set(finished_at) == set(added_at), "some request never finished"
    waits = [finished_at[r] - added_at[r] for r in added_at]
    assert max(waits) < 1000, f"a request waited {max(waits)} steps"
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert_empty(scheduler)
