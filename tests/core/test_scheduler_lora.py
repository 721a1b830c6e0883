"""LoRA admission (loom/lora.py): the running requests use at most max_loras adapters; a
request for one more waits in its place while later requests for running adapters and
for the base go by, and runs, in arrival order, once an adapter's requests have finished."""

from __future__ import annotations

from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.request import Request
from loom.sampling_params import SamplingParams


def make_scheduler(max_loras: int | None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=128),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks=64,
                     max_loras=max_loras)


def make_request(req_id: str, lora: str | None, max_tokens: int) -> Request:
    return Request(req_id, [10, 11, 12, 13, 14],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora_name=lora),
                   eos_token_ids={2})


def run(scheduler: Scheduler, requests: list[Request]) -> tuple[list[str], list[set]]:
    """Every request to the end: the order requests were admitted in and each step's
    adapters among the running requests."""
    for request in requests:
        scheduler.add_request(request)
    runner = FakeRunner()
    admitted: list[str] = []
    step_loras: list[set] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        admitted += [new.req_id for new in out.scheduled_new_reqs]
        step_loras.append({scheduler.requests[r].sampling_params.lora_name
                           for r in out.num_scheduled_tokens} - {None})
        step_loras[-1] |= {r.sampling_params.lora_name for r in scheduler.running} - {None}
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    assert_empty(scheduler)
    return admitted, step_loras


def test_one_more_adapter_waits_in_order_and_lets_others_by():
    scheduler = make_scheduler(max_loras=1)
    requests = [make_request("x1", "x", 3), make_request("y1", "y", 2),
                make_request("base", None, 6), make_request("x2", "x", 5),
                make_request("z1", "z", 2), make_request("y2", "y", 2)]
    admitted, step_loras = run(scheduler, requests)
    assert max(len(loras) for loras in step_loras) == 1
    # x's requests and the base go first; y (both its requests) once x's have finished,
    # then z: arrival order among the ones that waited
    assert admitted == ["x1", "base", "x2", "y1", "y2", "z1"]


def test_two_slots_take_two_adapters_at_once():
    scheduler = make_scheduler(max_loras=2)
    requests = [make_request("x1", "x", 4), make_request("y1", "y", 4),
                make_request("z1", "z", 2)]
    admitted, step_loras = run(scheduler, requests)
    assert step_loras[0] == {"x", "y"} and max(len(loras) for loras in step_loras) == 2
    assert admitted == ["x1", "y1", "z1"]


def test_without_lora_nothing_waits():
    scheduler = make_scheduler(max_loras=None)
    requests = [make_request(f"r{i}", name, 2) for i, name in enumerate("xyz")]
    admitted, step_loras = run(scheduler, requests)
    assert admitted == ["r0", "r1", "r2"] and step_loras[0] == {"x", "y", "z"}
