"""An image whose tokens attend to each other both ways (``MultiModalFeature.
bidirectional``, Gemma 3) runs in one step: chunks stop before it, a prefix-cache hit
inside it is followed by the rest of it at once, and one longer than a step's budget is
refused at admission. An image of a causal family is still cut by chunks."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty
from test_scheduler import make_request, make_scheduler, run_to_completion

from loom.core.wire import MultiModalFeature


def with_image(request, offset: int, length: int, bidirectional: bool = True,
               identifier: str = "image-a"):
    request.mm_features = [MultiModalFeature(modality="image", identifier=identifier,
                                             offset=offset, length=length,
                                             bidirectional=bidirectional)]
    return request


def scheduled(scheduler, runner) -> list[int]:
    """Each step's tokens of the one request until it finishes."""
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps += out.num_scheduled_tokens.values()
        scheduler.update_from_output(out, runner.execute(out, scheduler))
    return steps


@pytest.mark.parametrize("bidirectional, steps", [
    (True, [8, 16, 6, 1]),  # stops before the image at 8..23, then runs it whole
    (False, [16, 14, 1]),  # a causal family's image is cut like text
])
def test_chunks_stop_before_a_bidirectional_image(bidirectional, steps):
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(with_image(make_request("a", 30, max_tokens=2), 8, 16,
                                     bidirectional))
    assert scheduled(scheduler, FakeRunner()) == steps
    assert_empty(scheduler)


def test_an_image_longer_than_a_step_is_refused():
    scheduler = make_scheduler(budget=16)
    with pytest.raises(ValueError, match="fills 17 tokens, which attend to each other.*"
                                         "max_num_batched_tokens is 16"):
        scheduler.add_request(with_image(make_request("a", 30), 8, 17))
    scheduler.add_request(with_image(make_request("b", 30), 8, 17, bidirectional=False))
    run_to_completion(scheduler, FakeRunner())
    assert_empty(scheduler)


def test_a_prefix_hit_inside_an_image_runs_the_rest_in_one_step():
    """Blocks of 4: the repeat of a 20-token prompt whose image fills 6..19 hits 16
    tokens, inside the image; its first step runs 16..19 whole."""
    scheduler = make_scheduler(budget=16, block_size=4)
    runner = FakeRunner()
    scheduler.add_request(with_image(make_request("a", 20, max_tokens=1), 6, 14))
    assert scheduled(scheduler, runner) == [6, 14]
    scheduler.add_request(with_image(make_request("b", 20, max_tokens=1), 6, 14))
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 4}
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)
