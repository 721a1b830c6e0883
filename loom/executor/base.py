"""Executor: starts, watches and stops the workers; the engine's only handle on them."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from loom.config import EngineConfig
from loom.core.wire import ModelRunnerOutput, SchedulerOutput


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
    """Contract: ``initialize()`` brings every rank to ready, prints the KV cache's
    size (``kv_cache_summary``, from the bytes per block rank 0 reported) and returns
    the number of KV blocks all ranks can hold (the minimum over ranks);
    ``execute_model`` runs one step on every rank and returns rank 0's output;
    ``shutdown`` stops every rank and may be called more than once."""

    kv_cache_bytes_per_block: int  # rank 0's, set by initialize()
    # rank 0's ModelRunner.kv_cache_window (0: every layer reads every position) and its
    # KV cache groups (how many, how many of full attention), set by initialize(): the
    # scheduler frees blocks behind the window early
    kv_cache_window: int = 0
    kv_cache_num_groups: int = 1
    kv_cache_num_full_groups: int = 1

    @property
    def kv_cache_groups(self) -> list[int | None]:
        """Each KV cache group's window (None: full attention), full groups first."""
        window = self.kv_cache_window or None
        num_full = self.kv_cache_num_full_groups if window else self.kv_cache_num_groups
        return [None] * num_full + [window] * (self.kv_cache_num_groups - num_full)

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

    @abc.abstractmethod
    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, args: tuple = ()) -> list[Any]:
        """Run ``Worker.<method>(*args, **kwargs)`` on every rank, between steps; returns each
        rank's result in rank order. A rank's exception is raised here as the same type
        for ValueError and FileNotFoundError (the caller's fault, the ranks serve on),
        else as ``RPCError``."""


class RPCError(RuntimeError):
    """A worker method run by collective_rpc raised (other than ValueError or
    FileNotFoundError); the ranks serve on."""


class WeightsLostError(RuntimeError):
    """A weight update that failed while copying (after its checks passed): the
    half-written weights were freed on every rank, which now hold none, as after
    ``sleep(2)``; an update that succeeds (or ``wake_up``) brings weights back."""


def rpc_error(method: str, rank: int, exc_type: str | None, error: str) -> Exception:
    """The exception to raise for a rank's failed collective_rpc ``method``."""
    if exc_type == "ValueError":
        return ValueError(error)
    if exc_type == "FileNotFoundError":
        return FileNotFoundError(error)
    if exc_type == "WeightsLostError":
        return WeightsLostError(error)
    return RPCError(f"{method} failed on rank {rank}: {exc_type}: {error}")


def blocks_per_sequence(config: EngineConfig,
                        kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """The most blocks one sequence of ``max_model_len`` holds at once: in each full
    group one per ``block_size`` positions; in each sliding group of a hybrid cache
    (``kv_cache_groups``: each group's window) its window's and one step's tokens'.
    One group, windowed or not, counts every position (as before groups existed)."""
    block_size = config.cache.block_size
    seq_blocks = -(-config.model.max_model_len // block_size)
    if len(kv_cache_groups) == 1:
        return seq_blocks
    step = config.scheduler.max_num_batched_tokens
    return sum(seq_blocks if window is None
               else min(seq_blocks, (window - 1 + step - 1) // block_size + 2)
               for window in kv_cache_groups)


def cap_num_blocks(config: EngineConfig, num_blocks: int,
                   kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """No more blocks than ``max_num_seqs`` sequences of ``max_model_len`` can fill at once.

    Past that, memory would only keep stale prefix-cache entries, and on CPU every
    block is zeroed and resident. An explicit ``num_gpu_blocks_override`` is kept as is.
    """
    if config.cache.num_gpu_blocks_override is not None:
        return num_blocks
    blocks_per_seq = blocks_per_sequence(config, kv_cache_groups)
    return min(num_blocks, config.scheduler.max_num_seqs * blocks_per_seq)


def check_num_blocks(config: EngineConfig, num_blocks: int, bytes_per_block: int,
                     kv_cache_groups: Sequence[int | None] = (None,)) -> None:
    """Fail at start-up, naming the knobs, if one max_model_len sequence cannot fit."""
    block_size = config.cache.block_size
    needed = blocks_per_sequence(config, kv_cache_groups)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens) "
            f"but one sequence of max_model_len={config.model.max_model_len} needs {needed} "
            f"blocks ({needed * bytes_per_block / 2**20:.1f} MiB); lower --max-model-len or "
            "give the cache more memory (--kv-cache-memory or --memory-utilization)")


# The CPU's default KV cache (no --kv-cache-memory, no --memory-utilization): what the
# configured concurrency can fill, at most this much (vLLM's CPU default is 4 GiB).
# The default model fills it with 23,000 tokens, and `loom serve` stays under 2 GiB.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def lean_cpu_kv_cache_bytes(config: EngineConfig, bytes_per_block: int,
                            kv_cache_groups: Sequence[int | None] = (None,)) -> int:
    """The CPU's default KV budget: ``max_num_seqs`` sequences of ``max_model_len``, at
    most DEFAULT_CPU_KV_CACHE_BYTES, at least one sequence of max_model_len.

        SmolLM2-135M, bf16: 22.5 KiB a token; 64 x 4,096 tokens would be 5.6 GiB,
        capped to 0.5 GiB = 23,296 tokens = 5.7 sequences of 4,096
    """
    blocks_per_seq = blocks_per_sequence(config, kv_cache_groups)
    wanted = config.scheduler.max_num_seqs * blocks_per_seq * bytes_per_block
    return max(min(wanted, DEFAULT_CPU_KV_CACHE_BYTES), blocks_per_seq * bytes_per_block)


def kv_cache_summary(config: EngineConfig, num_blocks: int, bytes_per_block: int,
                     kv_cache_groups: Sequence[int | None] = (None,)) -> str:
    """One line for the start-up log: size, tokens, and how many max_model_len
    requests fit at once (as vLLM's "Maximum concurrency" line). A hybrid cache's
    blocks are shared by its groups: tokens counted as one sequence holds them."""
    max_model_len = config.model.max_model_len
    concurrency = num_blocks / blocks_per_sequence(config, kv_cache_groups)
    groups = (f" in {len(kv_cache_groups)} groups ({kv_cache_groups.count(None)} of full "
              f"attention)" if len(kv_cache_groups) > 1 else "")
    tokens = (num_blocks * config.cache.block_size if not groups
              else int(concurrency * max_model_len))
    return (f"KV cache {num_blocks * bytes_per_block / 2**30:.2f} GiB, {tokens:,} tokens "
            f"({num_blocks:,} blocks of {config.cache.block_size}{groups}); maximum concurrency "
            f"for {max_model_len:,} tokens per request: {concurrency:.2f}x")
