"""Worker: one device rank's model, KV cache and step execution.

The life cycle methods are called in order by whoever owns the worker: in-process
by ``UniProcExecutor``, or by ``worker_process.run_worker_proc`` in its own process.

    init_device -> load_model -> determine_num_blocks -> initialize_kv_cache
    -> warm_up -> execute_model ...
"""

from __future__ import annotations

import logging

import torch

from loom.config import EngineConfig
from loom.core.outputs import ModelRunnerOutput, SchedulerOutput
from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.worker import memory
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
            # Ranks on one host share its memory; this process's share, counted before
            # it loads anything (what it already holds is its own).
            share = self.config.parallel.ranks_per_node
            self.cpu_total_memory = (memory.cpu_available_memory() // share
                                     + memory.process_rss())
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.tp_group)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks every rank can hold (the minimum over ranks).

        ``num_gpu_blocks_override`` wins, then ``kv_cache_memory_bytes``; otherwise
        profile: run the largest step, measure the peak, and give the KV cache

            total_memory * memory_utilization - memory after loading - activation peak

        where total_memory is the device's (CUDA) or this rank's share of the
        memory available to the process when it started (CPU).
        """
        cache = self.config.cache
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes // bytes_per_block
        budget = self._profile_kv_budget()
        num_blocks = self.tp_group.all_reduce_min(max(0, budget // bytes_per_block))
        logger.info("rank %d: KV cache of %d blocks (%.1f MiB) from profiling", self.rank,
                    num_blocks, num_blocks * bytes_per_block / 2**20)
        return num_blocks

    def _profile_kv_budget(self) -> int:
        utilization = self.config.cache.memory_utilization
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.model_runner.profile_run()
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # Memory outside torch's allocator (CUDA context, NCCL buffers, other processes).
            non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)  # weights + activations
            self.profile = {"total": total, "peak": peak, "non_torch": non_torch}
            return int(total * utilization) - peak - non_torch
        used_after_load = memory.process_rss()
        exact = memory.reset_peak_rss()
        before = memory.process_rss() if exact else memory.peak_rss()
        scratch_kv_bytes = self.model_runner.profile_run()
        activation_peak = max(0, memory.peak_rss() - before - scratch_kv_bytes)
        self.profile = {"total": self.cpu_total_memory, "used_after_load": used_after_load,
                        "activation_peak": activation_peak}
        return int(self.cpu_total_memory * utilization) - used_after_load - activation_peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        """Nothing yet measurably speeds up steady-state steps on CPU."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
