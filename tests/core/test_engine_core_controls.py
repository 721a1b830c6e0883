"""The engine core's control calls (core/wire.py: Control), run between steps: which
wait for the requests in flight, and what is held meanwhile and released after."""

from __future__ import annotations

import pytest

from fake_runner import FakeRunner
from loom.config import CacheConfig, EngineConfig, ModelConfig
from loom.core.engine_core import EngineCore
from loom.core.wire import (GetStatus, PauseGeneration, ResumeGeneration, Sleep, UpdateWeights,
                            WakeUp, make_control)
from loom.request import Request
from loom.sampling_params import SamplingParams


class FakeExecutor:
    """The workers as FakeRunner; every collective_rpc answers {} and is recorded."""

    def __init__(self) -> None:
        self.runner = FakeRunner()
        self.scheduler = None  # the engine core's, for FakeRunner's checks
        self.rpcs: list[str] = []

    def initialize(self) -> int:
        return 64

    def execute_model(self, scheduler_output):
        return self.runner.execute(scheduler_output, self.scheduler)

    def collective_rpc(self, method, kwargs=None, timeout_s=None, args=()):
        self.rpcs.append(method)
        return [{}]

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_core() -> EngineCore:
    config = EngineConfig(model=ModelConfig(model="/models/tiny-llama", vocab_size=256),
                          cache=CacheConfig(block_size=4))
    core = EngineCore(config, FakeExecutor())
    core.executor.scheduler = core.scheduler
    return core


def request(request_id: str, max_tokens: int = 3) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset())


def step_until_ready(core: EngineCore, control) -> list[str]:
    """Step while ``control`` waits; the ids of the requests that finished meanwhile."""
    finished = []
    while not core.ready_for(control):
        finished += [output.req_id for output in core.step() if output.finished]
    return finished


def test_requests_that_arrive_while_an_update_waits_run_after_it():
    core = make_core()
    core.add_request(request("a"))
    update = UpdateWeights(path="/checkpoints/new")
    assert not core.ready_for(update)  # "a" is in flight
    core.add_request(request("b"))
    assert "b" not in core.scheduler.requests and core.status()["num_held"] == 1
    assert step_until_ready(core, update) == ["a"]
    assert core.run_control(update) == {}
    assert core.executor.rpcs == ["update_weights"]
    assert not core.is_holding and "b" in core.scheduler.requests
    finished = []
    while core.has_unfinished_requests():
        finished += [output.req_id for output in core.step() if output.finished]
    assert finished == ["b"]


def test_a_pause_holds_until_resumed_and_a_sleep_until_woken():
    core = make_core()
    core.add_request(request("a"))
    pause = PauseGeneration(mode="wait")
    assert not core.ready_for(pause) and core.paused  # holds from the call on
    step_until_ready(core, pause)
    assert core.run_control(pause) == []
    core.add_request(request("b"))
    assert core.run_control(GetStatus()) == {"paused": True, "is_sleeping": False,
                                             "sleep_level": 0, "num_held": 1}
    core.run_control(ResumeGeneration())
    assert not core.is_holding and "b" in core.scheduler.requests
    step_until_ready(core, Sleep(level=1))
    core.run_control(Sleep(level=1))
    core.add_request(request("c"))
    assert core.is_holding and "c" not in core.scheduler.requests
    core.run_control(WakeUp())
    assert not core.is_holding and "c" in core.scheduler.requests
    assert core.executor.rpcs == ["sleep", "wake_up"]


def test_a_failed_control_releases_what_its_drain_held():
    core = make_core()
    core.add_request(request("a"))
    sleep = Sleep(level=3)
    assert not core.ready_for(sleep)
    core.add_request(request("b"))
    step_until_ready(core, sleep)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        core.run_control(sleep)
    assert not core.is_holding and "b" in core.scheduler.requests


def test_a_control_is_named_by_its_tag_and_checked_by_its_fields():
    assert make_control("sleep", {"level": 2}) == Sleep(level=2)
    assert make_control("update_weights", {}) == UpdateWeights(path=None)
    with pytest.raises(ValueError, match="no control call 'nap'; known: collective_rpc, "):
        make_control("nap", {})
    with pytest.raises(ValueError, match=r"control call sleep: Expected `int`, got `str`"):
        make_control("sleep", {"level": "two"})
    with pytest.raises(ValueError, match="unknown field `lvl`"):
        make_control("sleep", {"lvl": 1})
