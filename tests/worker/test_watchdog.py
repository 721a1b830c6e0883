"""Progress, not liveness: no receive path drops a result, and a worker whose loop is
stuck while its process lives is found within its step's bound, with its stacks."""

from __future__ import annotations

import os
import threading
import time

import pytest

from loom import LLM, SamplingParams
from loom.config import EngineConfig, ModelConfig, ParallelConfig
from loom.core.wire import (ExecuteModel, ModelRunnerOutput, SchedulerOutput, StepResult,
                            WorkerShutdown)
from loom.errors import EngineDeadError, WorkerHungError
from loom.executor.multiproc import MultiProcExecutor
from loom.ipc.signal import WorkerSignals
from loom.ipc.task_queue import TaskQueue, TaskQueueAddresses, TaskQueueClient

from .helpers import executor_of, leftovers, make_model_dir

STEP = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                       num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                       finished_req_ids=[])


class FakeRank0:
    """Rank 0 on a thread: answers each step with ``reply(step)`` (None: no answer)."""

    def __init__(self, addresses: TaskQueueAddresses, reply) -> None:
        self.client = TaskQueueClient(addresses)
        self.reply = reply
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            message = self.client.poll(100)
            if isinstance(message, WorkerShutdown):
                break
            if isinstance(message, ExecuteModel):
                result = self.reply(message.step)
                if result is not None:
                    self.client.send(result)
        self.client.close()


@pytest.fixture
def bare_executor():
    """A MultiProcExecutor with its queue and signals but a rank on a thread."""
    config = EngineConfig(model=ModelConfig("unused"),
                          parallel=ParallelConfig(distributed_executor_backend="mp",
                                                  watchdog_timeout_s=1.0))
    executor = MultiProcExecutor(config)
    addresses, ipc_dir = TaskQueueAddresses.local(executor.instance_id)
    executor.queue = executor._resources.queue = TaskQueue(addresses, ipc_dir)
    executor.signals = executor._resources.signals = WorkerSignals.create(
        executor.instance_id, 1)
    ranks = []

    def start_rank(reply) -> None:
        ranks.append(FakeRank0(addresses, reply))
        while executor.queue.poll_subscriptions(timeout_ms=1000) < 1:
            pass

    yield executor, start_rank
    executor.shutdown()
    for rank in ranks:
        rank.thread.join(5)


def result(step: int) -> StepResult:
    return StepResult(step=step, output=ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]]))


def test_a_result_read_by_the_health_check_reaches_its_step(bare_executor):
    """A wedge loom once had: the health check polled the queue while rank 0's result was
    in flight and threw it away; the engine then waited forever. Here the result is
    delivered exactly inside that window: after the broadcast, before the step's wait."""
    executor, start_rank = bare_executor
    start_rank(result)
    broadcast = executor.queue.broadcast

    def broadcast_then_health_check(message) -> None:
        broadcast(message)
        assert executor.queue._results.poll(5000)  # rank 0's result has arrived...
        executor.check_health()  # ...and the health check is the one to read it

    executor.queue.broadcast = broadcast_then_health_check
    started = time.monotonic()
    for _ in range(3):
        assert executor.execute_model(STEP).sampled_token_ids == [[7]]
    assert time.monotonic() - started < 1.0  # far inside the 1 s step bound: not a rescue


def test_a_result_for_another_step_is_an_error_not_silence(bare_executor):
    executor, start_rank = bare_executor
    start_rank(lambda step: result(step + 5))
    with pytest.raises(EngineDeadError, match=r"unexpected StepResult \(step 6\) while "
                                              r"waiting for step 1"):
        executor.execute_model(STEP)
    with pytest.raises(EngineDeadError):  # and the engine stays dead
        executor.execute_model(STEP)


def test_a_step_past_its_bound_is_a_hang(bare_executor):
    executor, start_rank = bare_executor
    start_rank(lambda step: None)  # rank 0 never answers
    started = time.monotonic()
    with pytest.raises(WorkerHungError, match=r"step 1 \(1 tokens\) has run for .* past its "
                                              r"bound of 1\.0s"):
        executor.execute_model(STEP)
    assert time.monotonic() - started < 1.0 + 2.0


def test_the_bound_grows_with_the_step(bare_executor):
    parallel = bare_executor[0].config.parallel
    assert parallel.step_bound_s(0) == 1.0
    assert parallel.step_bound_s(2048) == pytest.approx(1.0 + 2048 * 0.02)
    # a vision tower's placeholder tokens cost more: 80 ms each on top
    assert parallel.step_bound_s(300, 256) == pytest.approx(1.0 + 300 * 0.02 + 256 * 0.08)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_worker_stuck_in_a_step_is_found_with_its_stacks(model_dir, monkeypatch, capfd,
                                                           caplog, tensor_parallel_size):
    """The rank's process lives and, before this change, its heartbeat thread kept beating;
    now the step's bound finds it, its stacks are logged, and nothing is left behind."""
    monkeypatch.setenv("LOOM_TEST_STALL_WORKER_AT_STEP", "3")
    llm = LLM(model_dir, tensor_parallel_size=tensor_parallel_size,
              distributed_executor_backend="mp", max_model_len=128,
              num_gpu_blocks_override=64, dtype="float32", watchdog_timeout_s=2.0,
              enable_warm_up=False)
    executor = executor_of(llm)
    pids, shm_names = executor.worker_pids, executor.shm_names
    started = time.monotonic()
    with pytest.raises(WorkerHungError, match=r"is hung: step 3 .* past its bound"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - started < 2.0 + 5.0
    assert "hang: step 3" in caplog.text and "rank 0: in step 3" in caplog.text
    err = capfd.readouterr().err
    assert "most recent call first" in err and "_stall_forever" in err  # faulthandler
    deadline = time.monotonic() + 10
    while leftovers(pids, shm_names) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(pids, shm_names) == []
    with pytest.raises(WorkerHungError):  # later calls fail fast
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert not [n for n in os.listdir("/dev/shm") if executor.instance_id in n]
