"""Executors start, watch and stop the workers (``base.Executor`` is the contract).

``make_executor`` picks one as ``config.parallel`` asks: Ray actors with
``distributed_executor_backend="ray"``, worker processes for more than one rank or with
``"mp"``, else the worker in this process. Imports stay lazy, so an engine core that
drives worker processes never imports torch, and Ray is imported only when chosen.
"""

from __future__ import annotations

from loom.config import EngineConfig
from loom.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from loom.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.parallel.use_worker_processes:
        from loom.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config)
    from loom.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
