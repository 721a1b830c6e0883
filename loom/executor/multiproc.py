"""MultiProcExecutor: one spawned worker process per local rank, watched, then stopped.

Start-up: create the signals and the task queue (names and addresses carry this
instance's id), spawn the ranks, wait for ``ready`` on every rank while checking
that each process lives. A step: broadcast, wait for rank 0's result, and every
``HEALTH_CHECK_INTERVAL_S`` check that every process lives and beats. Any failure
raises ``WorkerDiedError`` naming the rank, stops the other ranks, and every later
call fails fast with the same error.

Whatever happens (an error, a GC'd engine, interpreter exit, SIGTERM) the workers
are stopped and every shared-memory segment and socket file is removed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref

from loom.core.outputs import ModelRunnerOutput, SchedulerOutput
from loom.executor.base import (EngineDeadError, Executor, WorkerDiedError, cap_num_blocks,
                                check_num_blocks)
from loom.ipc.signal import WorkerSignals
from loom.ipc.task_queue import (ExecuteModel, RemoteStatus, Shutdown, StepResult, TaskQueue,
                                 TaskQueueAddresses, WorkerFailure, new_instance_id)
from loom.worker.worker_process import WorkerSpec, run_worker_proc

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 0.2
SHUTDOWN_GRACE_S = 5.0


class _Resources:
    """What the executor must release; held apart from it so a finalizer can."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.queue: TaskQueue | None = None
        self.signals: WorkerSignals | None = None

    def release(self) -> None:
        if self.queue is not None:
            try:
                self.queue.broadcast(Shutdown())
            except Exception:
                pass
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(2.0)
        if self.queue is not None:
            self.queue.close()
        if self.signals is not None:
            self.signals.close()


class MultiProcExecutor(Executor):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.instance_id = new_instance_id()
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._dead: EngineDeadError | None = None
        self._step = 0
        self._last_health_check = 0.0

    # ----------------------------------------------------------------- start-up

    def initialize(self) -> int:
        parallel = self.config.parallel
        if parallel.node_rank != 0:
            raise ValueError("the engine runs on node 0; start the ranks of node "
                             f"{parallel.node_rank} with `loom worker --node-rank "
                             f"{parallel.node_rank}`")
        try:
            num_blocks = self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        _install_sigterm_handler()
        return num_blocks

    def _start_workers(self) -> int:
        parallel = self.config.parallel
        resources = self._resources
        resources.signals = WorkerSignals.create(self.instance_id, parallel.world_size)
        if parallel.nnodes == 1:
            addresses, ipc_dir = TaskQueueAddresses.local(self.instance_id)
            master_port = parallel.master_port or _free_port(parallel.master_addr)
        else:
            addresses, ipc_dir = TaskQueueAddresses.tcp(parallel.master_addr,
                                                         parallel.master_port), None
            master_port = parallel.master_port
        resources.queue = self.queue = TaskQueue(addresses, ipc_dir)
        self.signals = resources.signals

        started = time.monotonic()
        context = multiprocessing.get_context("spawn")
        for rank in range(parallel.ranks_per_node):  # node 0 holds the first ranks
            spec = WorkerSpec(config=self.config, rank=rank, instance_id=self.instance_id,
                              addresses=addresses, master_addr=parallel.master_addr,
                              master_port=master_port, parent_pid=os.getpid(), local=True,
                              log_level=logging.getLevelName(logging.getLogger("loom")
                                                             .getEffectiveLevel()))
            process = context.Process(target=run_worker_proc, args=(spec,), daemon=True,
                                      name=f"loom-worker-{self.instance_id}-{rank}")
            process.start()
            resources.processes.append(process)

        deadline = started + parallel.worker_start_timeout_s
        while not (self.signals.ready.all()
                   and self.queue.poll_subscriptions() >= parallel.world_size):
            self._receive(timeout_ms=100, during="start-up")
            self._check_processes(during="start-up")
            if time.monotonic() > deadline:
                waiting = [r for r in range(parallel.world_size) if not self.signals.ready[r]]
                raise WorkerDiedError(
                    f"ranks {waiting} were not ready after worker_start_timeout_s="
                    f"{parallel.worker_start_timeout_s:.0f}s; is every node's `loom worker` "
                    "running with the same --master-addr/--master-port?")
        self.profiled_num_blocks = int(self.signals.profiled_blocks.min())
        num_blocks = cap_num_blocks(self.config, self.profiled_num_blocks)
        self.startup_time_s = time.monotonic() - started
        from loom.model.loader import kv_cache_bytes_per_block, load_hf_config
        from loom.worker.model_runner import torch_dtype

        bytes_per_block = kv_cache_bytes_per_block(
            load_hf_config(self.config.model.model), self.config.cache.block_size,
            torch_dtype(self.config.model.dtype), parallel.world_size)
        check_num_blocks(self.config, num_blocks, bytes_per_block)
        logger.info("%d worker(s) ready in %.1fs; %d KV blocks", parallel.world_size,
                    self.startup_time_s, num_blocks)
        return num_blocks

    # ----------------------------------------------------------------- steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise self._dead
        self._step += 1
        step = self._step
        try:
            self.queue.broadcast(ExecuteModel(step=step, scheduler_output=scheduler_output))
            while True:
                message = self._receive(timeout_ms=int(HEALTH_CHECK_INTERVAL_S * 1000))
                if isinstance(message, StepResult) and message.step == step:
                    return message.output
                if time.monotonic() - self._last_health_check >= HEALTH_CHECK_INTERVAL_S:
                    self.check_health()
        except EngineDeadError:
            raise
        except BaseException:
            # Interrupted mid-step (Ctrl-C): the ranks are out of step with us now.
            self._fail(EngineDeadError(f"step {step} was interrupted; the engine must be "
                                       "rebuilt"), raise_it=False)
            raise

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank exited or its heartbeat is older than
        worker_health_timeout_s. Cheap; a server may poll it while idle."""
        if self._dead is not None:
            raise self._dead
        self._last_health_check = time.monotonic()
        self._receive(timeout_ms=0)
        self._check_processes(during="serving")
        timeout = self.config.parallel.worker_health_timeout_s
        ages = time.time() - self.signals.heartbeat
        for rank, age in enumerate(ages):
            if age > timeout:
                self._fail(WorkerDiedError(
                    f"worker rank {rank} has not sent a heartbeat for {age:.0f}s "
                    f"(worker_health_timeout_s={timeout:g}); it is hung or its host is gone",
                    rank=rank))

    def _receive(self, timeout_ms: int, during: str = "serving"):
        """The next message; failures raise, remote status lands in the signals."""
        message = self.queue.poll(timeout_ms)
        while isinstance(message, RemoteStatus):
            for name in ("loaded", "ready", "profiled_blocks"):
                getattr(self.signals, name)[message.rank] = getattr(message, name)
            self.signals.heartbeat[message.rank] = time.time()  # our clock, not theirs
            message = self.queue.poll(0)
        if isinstance(message, WorkerFailure):
            self._raise_failure(message, during)
        return message

    def _raise_failure(self, failure: WorkerFailure, during: str) -> None:
        if during == "start-up" and failure.exc_type == "ValueError":
            # A configuration the ranks cannot run (e.g. no room for the KV cache).
            self._fail(ValueError(failure.error.removeprefix("ValueError: ")))
        # A rank that died makes its peers' collectives fail; name the dead one.
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            for rank, process in enumerate(self._resources.processes):
                if rank != failure.rank and process.exitcode not in (None, 0):
                    logger.debug("rank %d then failed:\n%s", failure.rank, failure.traceback)
                    self._fail(WorkerDiedError(
                        f"worker rank {rank} (pid {process.pid}) died during {during} with "
                        f"{_describe_exit(process.exitcode)}", rank=rank,
                        exitcode=process.exitcode))
            time.sleep(0.02)
        logger.error("worker rank %d failed:\n%s", failure.rank, failure.traceback)
        self._fail(WorkerDiedError(f"worker rank {failure.rank} failed during {during}: "
                                   f"{failure.error}", rank=failure.rank))

    def _check_processes(self, during: str) -> None:
        for rank, process in enumerate(self._resources.processes):
            if process.exitcode is None:
                continue
            # A rank that raised reports why before it exits; prefer that message.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                self._receive(timeout_ms=50, during=during)
            self._fail(WorkerDiedError(
                f"worker rank {rank} (pid {process.pid}) died during {during} with "
                f"{_describe_exit(process.exitcode)}", rank=rank, exitcode=process.exitcode))

    def _fail(self, error: Exception, raise_it: bool = True) -> None:
        if isinstance(error, EngineDeadError):
            self._dead = error
        self.shutdown()
        if raise_it:
            raise error

    # ----------------------------------------------------------------- stop

    def shutdown(self) -> None:
        """Stop every rank and remove every segment and socket file. Idempotent."""
        if self._dead is None:
            self._dead = EngineDeadError("the engine has been shut down")
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._resources.processes]

    @property
    def shm_names(self) -> list[str]:
        return list(WorkerSignals.names(self.instance_id).values())


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _install_sigterm_handler() -> None:
    """Turn SIGTERM into SystemExit so finalizers stop the workers; only where nobody
    else handles it (and only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
