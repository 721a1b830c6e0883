"""The KV offload tier's scheduler half (core/kv_tier.py) driven by a fake runner that
keeps what every KV block and tier slot holds: each position a step reads must hold its
request's token, whatever the tier saved, loaded or refused."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.kv_tier import KVTier, TierBlock, split_key
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams

BLOCK = 4


class ContentRunner(FakeRunner):
    """A FakeRunner whose KV blocks hold tokens: a step's tier copies first (saves, then
    loads, as a rank does), then every position the step reads is checked against the
    request's tokens, then the step's positions are written. ``corrupt``: slots whose
    records a rank refuses."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cache: dict[int, list[int | None]] = {}
        self.slots: dict[int, tuple[int, int, list[int | None]]] = {}
        self.corrupt: set[int] = set()
        self.num_loaded = 0

    def execute(self, out, scheduler=None):
        refused = []
        if out.kv_tier_ops is not None:
            for copy in out.kv_tier_ops.saves:
                self.slots[copy.slot] = (copy.block_hash, copy.group,
                                         list(self.cache.get(copy.block_id, [None] * BLOCK)))
            for i, copy in enumerate(out.kv_tier_ops.loads):
                record = self.slots.get(copy.slot)
                if (record is None or record[:2] != (copy.block_hash, copy.group)
                        or copy.slot in self.corrupt):
                    refused.append(i)
                    self.cache[copy.block_id] = [-1] * BLOCK  # whatever a refused load leaves
                else:
                    self.cache[copy.block_id] = list(record[2])
                    self.num_loaded += 1
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        starts.update({req_id: self.num_computed[req_id] for req_id in out.num_scheduled_tokens
                       if req_id not in starts})
        output = super().execute(out, scheduler)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            tokens, start = self.tokens[req_id], starts[req_id]
            for table in self.block_ids[req_id]:
                for position in range(start):  # what attention reads
                    held = self.cache.get(table[position // BLOCK], [None] * BLOCK)
                    assert held[position % BLOCK] == tokens[position], (
                        f"{req_id} reads position {position} from block "
                        f"{table[position // BLOCK]}, which holds {held}")
                for position in range(start, min(start + num_tokens, len(tokens))):
                    block = self.cache.setdefault(table[position // BLOCK], [None] * BLOCK)
                    block[position % BLOCK] = tokens[position]
        if refused:
            output.kv_tier_failed = refused
        return output


def make_scheduler(num_blocks: int, tier_slots: int, budget=64, max_num_seqs=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=256),
                     CacheConfig(block_size=BLOCK), num_blocks=num_blocks,
                     kv_tier_slots=tier_slots)


def make_request(req_id: str, prompt: list[int], max_tokens=4) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids={2})


def run(scheduler: Scheduler, runner: ContentRunner, requests: list[Request]) -> dict:
    """Add the requests, step until done; each request's outputs."""
    for request in requests:
        scheduler.add_request(request)
    outputs = {}
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for output in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            outputs.setdefault(output.req_id, []).append(output)
    assert not scheduler.has_unfinished_requests()
    return outputs


def tokens_of(outputs, req_id):
    return [t for output in outputs[req_id] for t in output.new_token_ids]


def test_an_evicted_prefix_comes_back_from_the_tier():
    """A's 20-token prompt fills 5 blocks; B's evicts them all into the tier. A again:
    one step loads its 4 full prompt blocks (the 5th holds the recomputed last token),
    and the next admits it with 16 cached tokens, which hold A's tokens."""
    scheduler, runner = make_scheduler(num_blocks=8, tier_slots=32), ContentRunner()
    prompt_a, prompt_b = list(range(10, 30)), list(range(100, 128))
    first = run(scheduler, runner, [make_request("a", prompt_a)])
    run(scheduler, runner, [make_request("b", prompt_b)])
    tier = scheduler.kv_cache.tier
    assert tier.stats.saves >= 5 and runner.num_loaded == 0
    scheduler.add_request(make_request("a2", prompt_a))
    out = scheduler.schedule()
    assert not out.num_scheduled_tokens and len(out.kv_tier_ops.loads) == 4
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a2": 4} and not out.kv_tier_ops.loads
    assert scheduler.requests["a2"].num_cached_tokens == 16
    outputs = {"a2": scheduler.update_from_output(out, runner.execute(out, scheduler))}
    outputs["a2"] += run(scheduler, runner, [])["a2"]
    assert tokens_of(outputs, "a2") == tokens_of(first, "a")
    assert runner.num_loaded == 4 and scheduler.prefix_cache_hits == 16
    assert_empty(scheduler)


def test_a_refused_record_is_a_miss_and_computed():
    """The tier's copy of A's third block is refused: A2's hit stops before it (two
    blocks from the tier are good), the key leaves the tier, and A2 computes the rest."""
    scheduler, runner = make_scheduler(num_blocks=8, tier_slots=32), ContentRunner()
    prompt = list(range(10, 30))
    run(scheduler, runner, [make_request("a", prompt)])
    run(scheduler, runner, [make_request("b", list(range(100, 128)))])
    tier = scheduler.kv_cache.tier
    probe = make_request("probe", prompt)
    scheduler.kv_cache.get_computed_blocks(probe, with_tier=True)
    third = probe.block_hashes[2]
    runner.corrupt.add(tier._slot_of[third])
    scheduler.add_request(make_request("a2", prompt))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert third not in tier and tier.stats.load_failures == 1
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a2": 12}  # blocks 0, 1 from the tier; 8 .. 19 computed
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run(scheduler, runner, [])
    assert_empty(scheduler)


@pytest.mark.parametrize("tier_slots", [0, 3, 64])
def test_preempted_requests_resume_from_the_tier(tier_slots):
    """Four requests of 16 prompt + 24 output tokens in 24 blocks (40 needed): the newest
    are preempted again and again. Their full blocks go to the tier as the pool reuses
    them and come back when they resume; a tier of 3 slots evicts all the time. The
    outputs are those of a pool large enough for all, and no step reads a wrong block."""
    requests = [make_request(f"r{i}", list(range(10 + 40 * i, 26 + 40 * i)), max_tokens=24)
                for i in range(4)]
    scheduler, runner = make_scheduler(num_blocks=24, tier_slots=tier_slots), ContentRunner()
    outputs = run(scheduler, runner, requests)
    assert scheduler.num_preemptions > 0
    roomy = make_scheduler(num_blocks=64, tier_slots=0)
    reference = run(roomy, ContentRunner(),
                    [make_request(r.request_id, r.prompt_token_ids, 24) for r in requests])
    assert roomy.num_preemptions == 0
    for request in requests:
        assert tokens_of(outputs, request.request_id) == tokens_of(reference, request.request_id)
    if tier_slots:
        tier = scheduler.kv_cache.tier
        assert runner.num_loaded > 0 and tier.stats.loads == runner.num_loaded
        assert len(tier) <= tier_slots
        if tier_slots == 3:
            assert tier.stats.evictions > 0
    assert_empty(scheduler)


def test_tier_evicts_least_recently_used_and_never_a_pinned_slot():
    tier = KVTier(2)
    tier.save(0, 11)
    tier.save(1, 12)
    tier.pin([11])  # 11 is loaded this step: 12 is the one to go
    tier.add_load(5, 11)
    tier.save(2, 13)
    assert 11 in tier and 12 not in tier and 13 in tier
    tier.pin([13])
    tier.add_load(6, 13)
    tier.save(3, 14)  # every slot is read this step: the save is dropped
    assert 14 not in tier and tier.stats.saves_dropped == 1
    ops = tier.take_ops()
    assert [(c.block_id, c.slot) for c in ops.saves] == [(0, 0), (1, 1), (2, 1)]
    assert [(c.block_id, c.block_hash) for c in ops.loads] == [(5, 11), (6, 13)]
    assert tier.take_ops() is None
    tier.save(4, (15, 2))  # another group's key: (hash, group) on the wire
    assert split_key((15, 2)) == (15, 2) and tier.take_ops().saves[0].group == 2
    tier.clear()
    assert len(tier) == 0


def test_a_block_is_saved_only_when_its_hash_leaves_the_pool():
    """A block whose hash another block holds in the cache (two requests computed the
    same tokens) is not saved when reused; the cached one is."""
    manager = KVCacheManager(4, BLOCK, tier=KVTier(8))
    a, b = make_request("a", list(range(10, 19))), make_request("b", list(range(10, 19)))
    manager.allocate_slots(a, 9)
    manager.allocate_slots(b, 9)  # computed alongside: its blocks hold the same hashes
    manager.free(a)
    manager.free(b)
    manager.get_computed_blocks(a)
    manager.allocate_slots(make_request("c", list(range(50, 66))), 16)
    saved = manager.tier.take_ops().saves
    assert sorted(c.block_hash for c in saved) == sorted(a.block_hashes)
    assert len(saved) == 2


def test_a_lookup_counts_the_tier_only_when_asked():
    manager = KVCacheManager(4, BLOCK, tier=KVTier(8))
    a = make_request("a", list(range(10, 23)))
    manager.allocate_slots(a, 13)
    manager.free(a)
    manager.allocate_slots(make_request("c", list(range(50, 66))), 16)  # evicts all of a's
    manager.tier.take_ops()
    assert manager.get_computed_blocks(a)[1] == 0
    hits, num_hit = manager.get_computed_blocks(a, with_tier=True)
    assert num_hit == 12 and all(isinstance(block, TierBlock) for block in hits[0])


def test_blocks_a_preempted_step_never_filled_leave_the_prefix_cache():
    """A request scheduled, then preempted in the same step (priority policy, undoing its
    chunk): the blocks that chunk was to fill were registered when allocated, and go."""
    manager = KVCacheManager(8, BLOCK)
    request = make_request("a", list(range(10, 30)))
    manager.allocate_slots(request, 8)
    request.num_computed_tokens = 8  # the first chunk ran
    manager.allocate_slots(request, 12)  # the second is scheduled: blocks 2..4 registered
    assert manager.get_computed_blocks(make_request("probe", request.prompt_token_ids))[1] == 19 // 4 * 4
    manager.forget_unwritten_blocks(request)  # then undone
    manager.free(request)
    assert manager.get_computed_blocks(make_request("probe", request.prompt_token_ids))[1] == 8
