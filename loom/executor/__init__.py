"""Executors start, watch and stop the workers (``base.Executor`` is the contract).

``make_executor`` picks one as ``config.parallel`` asks: worker processes for more than
one rank or with ``distributed_executor_backend="mp"``, else the worker in this process.
Imports stay lazy, so an engine core that drives worker processes never imports torch.
"""

from __future__ import annotations

from loom.config import EngineConfig
from loom.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel.use_worker_processes:
        from loom.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config)
    from loom.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
