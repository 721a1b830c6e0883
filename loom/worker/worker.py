"""Worker: one device rank's model, KV cache and step execution.

The life cycle methods are called in order by whoever owns the worker: in-process
by ``UniProcExecutor``, or by ``worker_process.run_worker_proc`` in its own process.

    init_device -> load_model -> determine_num_blocks -> initialize_kv_cache
    -> warm_up -> execute_model ...
"""

from __future__ import annotations

import logging

import psutil
import torch

from loom.config import EngineConfig
from loom.core.outputs import ModelRunnerOutput, SchedulerOutput
from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_group: TPGroup = SINGLE) -> None:
        self.config = config
        self.rank = rank
        self.tp_group = tp_group
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.config.device == "cuda":
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.tp_group)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks this rank can hold, from its memory budget.

        The budget is ``kv_cache_memory_bytes`` when given, else ``memory_utilization``
        of the memory still available after loading the weights (CPU: the host's
        available memory; CUDA: the device's free memory).
        """
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.memory_utilization)
        else:
            budget = int(psutil.virtual_memory().available * cache.memory_utilization)
        return budget // self.model_runner.kv_cache_bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        """Nothing yet measurably speeds up steady-state steps on CPU."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
