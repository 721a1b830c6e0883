"""Executor: starts, watches and stops the workers; the engine's only handle on them."""

from __future__ import annotations

import abc

from loom.config import EngineConfig
from loom.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """Contract: ``initialize()`` brings every rank to ready and returns the number of
    KV blocks all of them can hold (the minimum over ranks); ``execute_model`` runs one
    step on every rank and returns rank 0's output; ``shutdown`` stops every rank and
    may be called more than once."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def initialize(self) -> int: ...

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def check_num_blocks(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> None:
    """Fail at start-up, naming the knobs, if one max_model_len sequence cannot fit."""
    block_size = config.cache.block_size
    needed = -(-config.model.max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens) "
            f"but one sequence of max_model_len={config.model.max_model_len} needs {needed} "
            f"blocks ({needed * bytes_per_block / 2**20:.1f} MiB); lower --max-model-len or "
            "give the cache more memory (--kv-cache-memory or --memory-utilization)")
