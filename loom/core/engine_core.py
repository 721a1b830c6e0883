"""EngineCore: the scheduler and the executor in one loop. One ``step()`` is:

    schedule() -> SchedulerOutput -> every rank executes -> rank 0's ModelRunnerOutput
    -> update_from_output() -> EngineCoreOutputs

It imports no torch: the executor it drives is handed in.
"""

from __future__ import annotations

from typing import Protocol

from loom.config import EngineConfig
from loom.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from loom.core.scheduler import Scheduler, SchedulerStats
from loom.request import Request, RequestStatus


class ExecutorLike(Protocol):
    def initialize(self) -> int: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: ExecutorLike) -> None:
        self.config = config
        self.executor = executor
        self.num_blocks = executor.initialize()
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
