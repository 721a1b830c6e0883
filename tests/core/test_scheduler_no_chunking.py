"""enable_chunked_prefill=False: a prompt runs whole in one step or waits, first in line.
Driven by the fake runner; every test ends with the empty check."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty
from test_scheduler import make_request, run_to_completion

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler


def make_scheduler(budget: int, chunked: bool, max_model_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=4, enable_prefix_caching=False), num_blocks=64)


def test_a_prompt_waits_for_room_instead_of_splitting():
    scheduler = make_scheduler(budget=64, chunked=False)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 40, max_tokens=3))
    scheduler.add_request(make_request("b", 30, max_tokens=3, first_token=100))
    scheduler.add_request(make_request("c", 5, max_tokens=3, first_token=150))
    out = scheduler.schedule()
    # a runs whole (40); b (30) does not fit the 24 left and is not split; c must not
    # overtake b, the head of the queue.
    assert out.num_scheduled_tokens == {"a": 40}
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 30, "c": 5}
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    outputs = run_to_completion(scheduler, runner)
    assert {req_id for req_id in outputs} == {"a", "b", "c"}
    assert_empty(scheduler)


def test_the_same_requests_are_chunked_when_chunked_prefill_is_on():
    scheduler = make_scheduler(budget=64, chunked=True)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 40, max_tokens=3))
    scheduler.add_request(make_request("b", 30, max_tokens=3, first_token=100))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 40, "b": 24}  # b's first chunk
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_budget_below_max_model_len_is_refused_without_chunking():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than "
                                         r"max_model_len \(64\).*--max-num-batched-tokens"):
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=32, max_model_len=64)  # fine with chunking
