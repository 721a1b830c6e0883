"""Executor: starts, watches and stops the workers; the engine's only handle on them."""

from __future__ import annotations

import abc
from typing import Any

from loom.config import EngineConfig
from loom.core.wire import ModelRunnerOutput, SchedulerOutput
from loom.errors import RPCError, WeightsLostError


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


def rpc_error(method: str, rank: int, exc_type: str | None, error: str) -> Exception:
    """The exception to raise for a rank's failed collective_rpc ``method``."""
    if exc_type == "ValueError":
        return ValueError(error)
    if exc_type == "FileNotFoundError":
        return FileNotFoundError(error)
    if exc_type == "WeightsLostError":
        return WeightsLostError(error)
    return RPCError(f"{method} failed on rank {rank}: {exc_type}: {error}")
