"""The scheduler's encoder budget: an image's embeddings are made when its first
placeholder token runs, at most ``max_num_batched_tokens`` rows of them a step; a chunk
stops before an image that does not fit what is left, an image larger than the whole
budget runs alone, and an image a running request resumes inside costs nothing again."""

from __future__ import annotations

from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.core.wire import MultiModalFeature
from loom.request import Request
from loom.sampling_params import SamplingParams


def make_scheduler(budget: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=256),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks=128)


def make_request(req_id: str, num_prompt: int, images: list[tuple[int, int]],
                 first_token: int = 10) -> Request:
    """``images``: (offset, length) of each image's placeholder span."""
    features = [MultiModalFeature(modality="image", identifier=f"{req_id}-{i}", offset=offset,
                                  length=length) for i, (offset, length) in enumerate(images)]
    return Request(req_id, list(range(first_token, first_token + num_prompt)),
                   SamplingParams(max_tokens=2, ignore_eos=True), mm_features=features)


def step(scheduler: Scheduler, runner: FakeRunner) -> dict[str, int]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    return dict(out.num_scheduled_tokens)


def test_a_chunk_stops_before_an_image_that_does_not_fit():
    scheduler, runner = make_scheduler(budget=16), FakeRunner()
    # image A (rows 2..9) uses 8 of the 16 rows; B's 10 rows do not fit beside it
    scheduler.add_request(make_request("a", 30, [(2, 8)]))
    scheduler.add_request(make_request("b", 30, [(1, 10)], first_token=100))
    assert step(scheduler, runner) == {"a": 16}  # a's first 16 tokens: image A whole
    # a's next chunk holds no new image; b's image (10 rows) fits the budget's 16
    assert step(scheduler, runner) == {"a": 14, "b": 2}
    # b resumes inside its image: no encoding again; it runs on
    assert step(scheduler, runner)["b"] > 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_two_images_in_one_chunk_share_the_budget():
    scheduler, runner = make_scheduler(budget=16), FakeRunner()
    # 6 + 6 rows fit; the third image's 6 would make 18: the chunk stops at its start
    scheduler.add_request(make_request("a", 40, [(0, 6), (6, 6), (13, 6)]))
    assert step(scheduler, runner) == {"a": 13}
    assert step(scheduler, runner) == {"a": 16}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_an_image_larger_than_the_budget_runs_alone():
    scheduler, runner = make_scheduler(budget=16), FakeRunner()
    scheduler.add_request(make_request("a", 10, [(0, 4)]))
    scheduler.add_request(make_request("big", 30, [(0, 20)], first_token=100))
    # a encodes 4 rows; big's 20 do not fit the 12 left: big waits, though tokens are left
    assert step(scheduler, runner) == {"a": 10}
    # nothing encoded yet this step: big's image, larger than the whole budget, runs
    assert step(scheduler, runner) == {"a": 1, "big": 15}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_each_step_says_how_many_placeholder_tokens_its_towers_make():
    """``num_encoder_tokens`` lengthens the step's time bound (step_bound_s): the images
    a step encodes, not those a running request resumes inside."""
    scheduler, runner = make_scheduler(budget=16), FakeRunner()
    scheduler.add_request(make_request("a", 30, [(2, 8)]))
    scheduler.add_request(make_request("b", 30, [(1, 10)], first_token=100))
    scheduler.add_request(make_request("big", 30, [(0, 20)], first_token=200))
    encoded = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        encoded.append(out.num_encoder_tokens)
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    # a's image; b's (beside a's next chunk); big's, alone, once a and b are done
    assert [n for n in encoded if n] == [8, 10, 20]
    assert encoded[:2] == [8, 10]
    assert_empty(scheduler)
