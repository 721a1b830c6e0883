"""Executor: starts, watches and stops the workers; the engine's only handle on them."""

from __future__ import annotations

import abc

from loom.config import EngineConfig
from loom.core.outputs import ModelRunnerOutput, SchedulerOutput


class EngineDeadError(RuntimeError):
    """The workers can no longer run steps; every request in flight has failed and the
    engine must be rebuilt."""


class WorkerDiedError(EngineDeadError):
    """A worker process exited, stopped heart-beating or raised."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class WorkerHungError(WorkerDiedError):
    """A worker process lives but makes no progress: a step past its time bound, or an
    idle event loop that stopped running."""


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

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if any rank is dead or hung; cheap, for idle polling."""


def cap_num_blocks(config: EngineConfig, num_blocks: int) -> int:
    """No more blocks than ``max_num_seqs`` sequences of ``max_model_len`` can fill at once.

    Past that, memory would only keep stale prefix-cache entries, and on CPU every
    block is zeroed and resident. An explicit ``num_gpu_blocks_override`` is kept as is.
    """
    if config.cache.num_gpu_blocks_override is not None:
        return num_blocks
    blocks_per_seq = -(-config.model.max_model_len // config.cache.block_size)
    return min(num_blocks, config.scheduler.max_num_seqs * blocks_per_seq)


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
