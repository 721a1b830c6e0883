"""--scheduling-policy priority: the waiting queue by (priority, arrival), the lowest-
priority running request preempted first; fcfs as before. A fake runner drives it."""

from __future__ import annotations

from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus
from loom.sampling_params import SamplingParams


def make_scheduler(policy: str, num_blocks=64, max_num_seqs=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                     max_model_len=256, policy=policy),
                     CacheConfig(block_size=4, enable_prefix_caching=False),
                     num_blocks=num_blocks)


def make_request(req_id: str, priority: int, arrival: float, num_prompt=8,
                 max_tokens=8) -> Request:
    return Request(req_id, list(range(10, 10 + num_prompt)),
                   SamplingParams(max_tokens=max_tokens, priority=priority), eos_token_ids={2},
                   arrival_time=arrival)


def run(scheduler, runner) -> tuple[list[str], list[str], dict[str, list[int]]]:
    """(the order requests first ran in, the preempted, each one's output tokens)."""
    started, preempted, outputs = [], [], {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        started += [new.req_id for new in out.scheduled_new_reqs
                    if new.req_id not in started]
        preempted += [req_id for req_id in out.finished_req_ids
                      if scheduler.requests.get(req_id) is not None
                      and scheduler.requests[req_id].status == RequestStatus.PREEMPTED]
        for o in scheduler.update_from_output(out, runner.execute(out, scheduler)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    return started, preempted, outputs


def test_waiting_requests_run_by_priority_then_arrival():
    scheduler = make_scheduler("priority", max_num_seqs=1)
    for req_id, priority, arrival in (("late-low", 5, 0.0), ("urgent", -1, 2.0),
                                      ("first-normal", 0, 1.0), ("second-normal", 0, 3.0)):
        scheduler.add_request(make_request(req_id, priority, arrival))
    started, _, _ = run(scheduler, FakeRunner())
    assert started == ["urgent", "first-normal", "second-normal", "late-low"]
    assert_empty(scheduler)


def test_fcfs_keeps_arrival_order_whatever_the_priority():
    scheduler = make_scheduler("fcfs", max_num_seqs=1)
    for req_id, arrival in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        scheduler.add_request(make_request(req_id, 0, arrival))
    assert run(scheduler, FakeRunner())[0] == ["a", "b", "c"]
    assert_empty(scheduler)


def test_the_lowest_priority_is_preempted_even_when_it_is_the_oldest():
    """6 blocks of 4 for two requests that need 4 each: the older one, of low priority,
    is preempted (fcfs would preempt the newer); both outputs are exact."""
    victims = {}
    for policy in ("priority", "fcfs"):
        runner = FakeRunner(next_token=lambda req_id, n: 500 + n)
        scheduler = make_scheduler(policy, num_blocks=6)
        scheduler.add_request(make_request("old-low", 3, 0.0))
        scheduler.add_request(make_request("new-high", 0, 1.0))
        _, preempted, outputs = run(scheduler, runner)
        victims[policy] = preempted[0]
        assert outputs["old-low"] == outputs["new-high"] == [500 + n for n in range(8, 16)]
        assert_empty(scheduler)
    assert victims == {"priority": "old-low", "fcfs": "new-high"}
