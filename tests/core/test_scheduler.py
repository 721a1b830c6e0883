"""Scheduler behaviour driven by a fake runner; every test ends with the empty check."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus
from loom.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     num_blocks=num_blocks)


def make_request(req_id: str, num_prompt: int, max_tokens=4, first_token=10, **params) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids={EOS})


def run_to_completion(scheduler, runner, max_steps=1000):
    outputs = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            outputs.setdefault(o.req_id, []).append(o)
    assert not scheduler.has_unfinished_requests()
    return outputs


def test_budget_split_and_chunked_prefill():
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("long", 40))
    scheduler.add_request(make_request("short", 5, first_token=100))
    runner = FakeRunner()
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 16}  # the whole budget; short must wait
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 16}
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    out = scheduler.schedule()
    # long's last chunk (8) leaves room for short's whole prompt (5) in the same step.
    assert out.num_scheduled_tokens == {"long": 8, "short": 5}
    assert out.total_num_scheduled_tokens == 13
    outs = scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert {o.req_id for o in outs} == {"long", "short"}  # both sampled their first token
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_running_requests_go_first():
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 7, max_tokens=10))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    scheduler.add_request(make_request("b", 20))
    out = scheduler.schedule()
    # a's decode token is booked before b's prefill takes the rest of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3))
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(scheduler.waiting) == 2
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_preemption_and_exact_resume():
    # 6 blocks of 4 = 24 slots; two requests of 8 prompt + 8 output need 32.
    scheduler = make_scheduler(num_blocks=6, caching=False)
    runner = FakeRunner(next_token=lambda req_id, n: 500 + n)
    scheduler.add_request(make_request("old", 8, max_tokens=8, first_token=10))
    scheduler.add_request(make_request("new", 8, max_tokens=8, first_token=50))
    outputs = {}
    preempted_seen = False
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if "new" in out.finished_req_ids:
            preempted_seen = True
            assert scheduler.requests["new"].status == RequestStatus.PREEMPTED
        for o in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert preempted_seen and scheduler.num_preemptions >= 1
    # The newest request was the victim; both outputs are exactly what they would be alone.
    assert outputs["old"] == [500 + n for n in range(8, 16)]
    assert outputs["new"] == [500 + n for n in range(8, 16)]
    assert_empty(scheduler)


def test_resumed_request_is_sent_whole_with_its_output():
    scheduler = make_scheduler(num_blocks=5, caching=False)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 8, max_tokens=8))
    scheduler.add_request(make_request("b", 8, max_tokens=8))
    resumed = None
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            if new.output_token_ids:
                resumed = new
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert resumed is not None and resumed.num_computed_tokens == 0
    assert_empty(scheduler)


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_in_any_state(when):
    scheduler = make_scheduler(budget=8)
    runner = FakeRunner()
    scheduler.add_request(make_request("x", 20, max_tokens=50))
    steps = {"waiting": 0, "prefilling": 1, "decoding": 4}[when]
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    request = scheduler.requests["x"]
    if when == "prefilling":
        assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    if when == "decoding":
        assert request.num_output_tokens > 0
    scheduler.abort_requests(["x"])
    assert request.status == RequestStatus.FINISHED_ABORTED
    out = scheduler.schedule()
    assert out.is_empty
    assert out.finished_req_ids == ([] if when == "waiting" else ["x"])
    assert_empty(scheduler)


def test_abort_while_step_in_flight_drops_its_output():
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("x", 5))
    out = scheduler.schedule()
    result = runner.execute(out, scheduler)
    scheduler.abort_requests("x")
    assert scheduler.update_from_output(out, result) == []
    assert_empty(scheduler)


def _finish_one(request, tokens, **kw):
    scheduler = make_scheduler(**kw)
    it = iter(tokens)
    runner = FakeRunner(next_token=lambda req_id, n: next(it))
    scheduler.add_request(request)
    outputs = run_to_completion(scheduler, runner)[request.request_id]
    assert_empty(scheduler)
    produced = [t for o in outputs for t in o.new_token_ids]
    return produced, outputs[-1]


def test_stop_on_eos():
    produced, last = _finish_one(make_request("r", 3, max_tokens=10), [5, 6, EOS, 7, 8])
    assert produced == [5, 6, EOS] and last.finish_reason == "stop" and last.stop_reason is None


def test_stop_token_ids_report_the_token():
    produced, last = _finish_one(make_request("r", 3, max_tokens=10, stop_token_ids=[6]), [5, 6, 7])
    assert produced == [5, 6] and last.finish_reason == "stop" and last.stop_reason == 6


def test_max_tokens():
    produced, last = _finish_one(make_request("r", 3, max_tokens=3), [5, 6, 7, 8])
    assert produced == [5, 6, 7] and last.finish_reason == "length"


def test_min_tokens_suppresses_early_stops():
    produced, last = _finish_one(make_request("r", 3, max_tokens=10, min_tokens=3,
                                              stop_token_ids=[6]), [EOS, 6, 5, EOS])
    assert produced == [EOS, 6, 5, EOS] and last.finish_reason == "stop"


def test_ignore_eos():
    produced, last = _finish_one(make_request("r", 3, max_tokens=4, ignore_eos=True),
                                 [EOS, EOS, EOS, EOS, EOS])
    assert produced == [EOS] * 4 and last.finish_reason == "length"


def test_max_model_len():
    produced, last = _finish_one(make_request("r", 6, max_tokens=None), [5] * 20, max_model_len=10)
    assert produced == [5] * 4 and last.finish_reason == "length"


def test_prompt_at_max_model_len_is_rejected():
    scheduler = make_scheduler(max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len is 10"):
        scheduler.add_request(make_request("r", 10))
    assert_empty(scheduler)


def test_stop_string_notice_from_output_side():
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("r", 3, max_tokens=20))
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    request = scheduler.requests["r"]
    scheduler.finish_requests("r", RequestStatus.FINISHED_STOPPED, stop_reason="###")
    assert request.status.finish_reason.value == "stop" and request.stop_reason == "###"
    assert scheduler.schedule().finished_req_ids == ["r"]
    assert_empty(scheduler)


def test_prefix_hit_after_owner_finished():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner()
    scheduler.add_request(make_request("owner", 14, max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("reader", 14, max_tokens=2))
    out = scheduler.schedule()
    # 14 prompt tokens = 3 full blocks + 2; all 3 full blocks hit, the tail is computed.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"reader": 2}
    assert scheduler.requests["reader"].num_cached_tokens == 12
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert scheduler.prefix_cache_hits == 12
    assert_empty(scheduler)


def test_last_prompt_token_is_always_recomputed():
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner()
    scheduler.add_request(make_request("owner", 8, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("again", 8, max_tokens=1))
    out = scheduler.schedule()
    # Both blocks are cached, but a hit may cover only 7 tokens: one block hits.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"again": 4}
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert_empty(scheduler)


def test_prefix_caching_off_never_hits():
    scheduler = make_scheduler(caching=False)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 12, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("b", 12, max_tokens=1))
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert_empty(scheduler)


def test_eviction_is_least_recently_freed_first():
    # 6 blocks; three finished requests leave their prefixes cached in free order.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    runner = FakeRunner()
    for i, first in enumerate((100, 200, 300)):
        scheduler.add_request(make_request(f"p{i}", 5, max_tokens=1, first_token=first))
        run_to_completion(scheduler, runner)
    # A fresh request needing 3 blocks evicts the oldest-freed ones first: p0's prefix.
    scheduler.add_request(make_request("big", 9, max_tokens=1, first_token=900))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    hits = {}
    for i, first in enumerate((100, 200, 300)):
        request = make_request(f"q{i}", 5, max_tokens=1, first_token=first)
        hits[i] = scheduler.kv_cache.get_computed_blocks(request)[1]
    assert hits == {0: 0, 1: 4, 2: 4}
    assert_empty(scheduler)


def test_forked_requests_share_prompt_blocks():
    # n > 1: the output side adds n requests with one prompt; they share its full blocks.
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(next_token=lambda req_id, n: 700 + int(req_id[-1]))
    params = SamplingParams(n=3, max_tokens=3)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    for i in range(3):
        scheduler.add_request(Request(f"req-{i}", prompt, params, parent_request_id="req", index=i))
    out = scheduler.schedule()
    blocks = {new.req_id: new.block_ids for new in out.scheduled_new_reqs}
    assert blocks["req-0"][:3] == blocks["req-1"][:3] == blocks["req-2"][:3]
    assert len({b[3] for b in blocks.values()}) == 3  # each has its own partial block
    assert out.num_scheduled_tokens == {"req-0": 13, "req-1": 1, "req-2": 1}
    shared = scheduler.kv_cache.pool.blocks[blocks["req-0"][0]]
    assert shared.ref_cnt == 3
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    outputs = run_to_completion(scheduler, runner)
    assert [t for o in outputs["req-2"] for t in o.new_token_ids] == [702, 702]
    assert_empty(scheduler)


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", 3))
    scheduler.abort_requests("r")
    assert_empty(scheduler)
