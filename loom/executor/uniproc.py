"""UniProcExecutor: one rank, in the caller's process. For tests and the offline API."""

from __future__ import annotations

from typing import Any

from loom.core.kv_sizing import cap_num_blocks, check_num_blocks, kv_cache_summary
from loom.core.wire import ModelRunnerOutput, SchedulerOutput
from loom.executor.base import Executor
from loom.progress import progress
from loom.worker.worker import Worker


class UniProcExecutor(Executor):
    def initialize(self) -> int:
        if self.config.parallel.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs one rank; use MultiProcExecutor for "
                             f"tensor_parallel_size={self.config.parallel.tensor_parallel_size}")
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()
        self.profiled_num_blocks = self.worker.determine_num_blocks()
        runner = self.worker.model_runner
        self.kv_cache_window = runner.kv_cache_window
        self.kv_cache_num_groups, self.kv_cache_num_full_groups = runner.kv_cache_group_counts
        groups = self.kv_cache_groups
        num_blocks = cap_num_blocks(self.config, self.profiled_num_blocks, groups)
        self.kv_cache_bytes_per_block = runner.kv_cache_bytes_per_block
        check_num_blocks(self.config, num_blocks, self.kv_cache_bytes_per_block, groups)
        self.worker.initialize_kv_cache(num_blocks)
        progress(kv_cache_summary(self.config, num_blocks, self.kv_cache_bytes_per_block,
                                  groups))
        self.worker.warm_up()
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, args: tuple = ()) -> list[Any]:
        if method.startswith("_") or not callable(getattr(self.worker, method, None)):
            raise ValueError(f"the worker has no method {method!r}")
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown_kv_connector()
            self.worker.shutdown_kv_tier()
        self.worker = None
