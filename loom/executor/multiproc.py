"""MultiProcExecutor: one spawned worker process per local rank, watched, then stopped.

Start-up: create the signals and the task queue (names and addresses carry this
instance's id), spawn the ranks, wait for ``ready`` on every rank while checking
that each process lives. A step: broadcast, wait for rank 0's result, and every
``HEALTH_CHECK_INTERVAL_S`` check that every process lives and makes progress.

Progress, not liveness, is what counts (``check_health``):

    a step in flight longer than its bound      ParallelConfig.step_bound_s(tokens)
    an idle rank whose event loop is silent     worker_health_timeout_s, counted from
                                                its last beat or the last step's end

Either is a hang: the stuck ranks' stacks go to the log (faulthandler, SIGUSR1),
every rank is killed and ``WorkerHungError`` is raised. A rank that exits or
raises gives ``WorkerDiedError`` naming it. After any failure every later call
fails fast with the same error.

Every message from the ranks goes through ``_receive``: a status lands in the
signals, a failure raises, and a step result is kept for the step that waits for
it, whoever happened to read it (a health check may). A result nobody waits for is
an ``UnexpectedMessageError``, never dropped.

Whatever happens (an error, a GC'd engine, interpreter exit) the workers are stopped
and every shared-memory segment and socket file is removed. This library installs no
signal handler: if the process is killed (SIGTERM's default, SIGKILL), its workers die
with it (PR_SET_PDEATHSIG) and multiprocessing's resource tracker unlinks the segments;
what a kill of the whole group leaves, the next engine removes (loom.ipc.debris).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from typing import Any

import msgspec

from loom.core.kv_sizing import cap_num_blocks, kv_cache_summary
from loom.core.wire import (ExecuteModel, ModelRunnerOutput, RemoteStatus, RPCResult,
                            SchedulerOutput, StepResult, WorkerFailure, WorkerRPC,
                            WorkerShutdown)
from loom.errors import EngineDeadError, WorkerDiedError, WorkerHungError
from loom.executor.base import Executor, rpc_error
from loom.ipc.debris import remove_debris
from loom.ipc.shm_ring import SenderRing
from loom.ipc.signal import WorkerSignals, segment_name
from loom.ipc.task_queue import (TaskQueue, TaskQueueAddresses, UnexpectedMessageError,
                                 new_instance_id)
from loom.progress import progress
from loom.worker.worker_process import WorkerSpec, run_worker_proc

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 0.2
SHUTDOWN_GRACE_S = 5.0
STACK_DUMP_WAIT_S = 0.5  # for a hung rank's faulthandler to write its stacks


class WorkerResources:
    """What the executor must release; held apart from it so a finalizer can."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.queue: TaskQueue | None = None
        self.signals: WorkerSignals | None = None
        self.mm_ring: SenderRing | None = None  # images' arrays to the ranks of this host

    def release(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        if self.queue is not None:
            try:
                self.queue.broadcast(WorkerShutdown())
            except Exception:
                pass
        deadline = time.monotonic() + grace_s
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
        if self.mm_ring is not None:
            self.mm_ring.close()


class MultiProcExecutor(Executor):
    # What _resources holds; each rank's handle there has Process's pid, exitcode,
    # is_alive(), join() and kill() (a Ray actor's too: ray_executor.RayRank).
    resources_type: type[WorkerResources] = WorkerResources
    # The likely cause, when ranks are not ready in time.
    not_ready_hint = ("is every node's `loom worker` running with the same "
                      "--master-addr/--master-port?")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.instance_id = new_instance_id()
        self._resources = self.resources_type()
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._dead: EngineDeadError | None = None
        self._step = 0
        self._last_health_check = 0.0
        # The step the ranks are running, when it was sent, its bound, and rank 0's
        # result for it once some receive has read it.
        self._step_in_flight: int | None = None
        self._step_sent = 0.0
        self._step_bound_s = 0.0
        self._step_tokens = 0
        self._step_encoder_tokens = 0
        self._result: StepResult | None = None
        self._last_step_end = time.time()
        # The collective_rpc in flight and the answers that have come for it, by rank.
        self._rpc_ids = itertools.count(1)
        self._rpc_in_flight: int | None = None
        self._rpc_results: dict[int, RPCResult] = {}

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
        return num_blocks

    def _start_workers(self) -> int:
        started = time.monotonic()
        remove_debris()
        self._launch_ranks()
        return self._wait_until_ready(started)

    def _launch_ranks(self) -> None:
        """Create the signals and the task queue, start every rank of node 0."""
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
        if parallel.nnodes == 1:  # every rank reads the ring (reader i: rank i); else inline
            resources.mm_ring = SenderRing(
                segment_name(os.getpid(), self.instance_id, "mm-ranks"),
                self.config.model.mm_shm_cache_size_mib, num_readers=parallel.ranks_per_node)

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

    def _wait_until_ready(self, started: float) -> int:
        """Wait for every rank's ready signal and subscription; returns the KV blocks."""
        parallel = self.config.parallel
        deadline = started + parallel.worker_start_timeout_s
        while not (self.signals.ready.all()
                   and self.queue.poll_subscriptions() >= parallel.world_size):
            self._receive(timeout_ms=100, during="start-up")
            self._check_processes(during="start-up")
            if time.monotonic() > deadline:
                waiting = [r for r in range(parallel.world_size) if not self.signals.ready[r]]
                raise WorkerDiedError(
                    f"ranks {waiting} were not ready after worker_start_timeout_s="
                    f"{parallel.worker_start_timeout_s:.0f}s; {self.not_ready_hint}")
        self.profiled_num_blocks = int(self.signals.profiled_blocks.min())
        self.kv_cache_window = int(self.signals.kv_cache_window[0])
        self.kv_cache_num_groups = int(self.signals.kv_cache_num_groups[0])
        self.kv_cache_num_full_groups = int(self.signals.kv_cache_num_full_groups[0])
        num_blocks = cap_num_blocks(self.config, self.profiled_num_blocks, self.kv_cache_groups)
        self.startup_time_s = time.monotonic() - started
        # Every rank ran check_num_blocks on this count before it allocated (a failure
        # arrived as its ValueError), and published the bytes of its blocks: nothing here
        # imports torch or reads the checkpoint's config (~250 MiB resident).
        self.kv_cache_bytes_per_block = int(self.signals.kv_cache_bytes_per_block[0])
        resident = [usage["rss"] / 2**20 for usage in self.collective_rpc("memory_usage")]
        logger.info("%d worker(s) ready in %.1fs; %d KV blocks; resident MiB per rank: %s",
                    parallel.world_size, self.startup_time_s, num_blocks,
                    ", ".join(f"{rss:.0f}" for rss in resident))
        progress(kv_cache_summary(self.config, num_blocks, self.kv_cache_bytes_per_block,
                                  self.kv_cache_groups))
        return num_blocks

    # ----------------------------------------------------------------- steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise self._dead
        self._step += 1
        step = self._step
        parallel = self.config.parallel
        self._step_tokens = scheduler_output.total_num_scheduled_tokens
        self._step_encoder_tokens = scheduler_output.num_encoder_tokens
        self._step_bound_s = parallel.step_bound_s(self._step_tokens, self._step_encoder_tokens)
        self._step_in_flight, self._step_sent = step, time.monotonic()
        try:
            self.queue.broadcast(ExecuteModel(step=step,
                                              scheduler_output=self._staged(scheduler_output)))
            while self._result is None:
                self._receive(timeout_ms=int(HEALTH_CHECK_INTERVAL_S * 1000))
                if (self._result is None and
                        time.monotonic() - self._last_health_check >= HEALTH_CHECK_INTERVAL_S):
                    self.check_health()
        except EngineDeadError:
            raise
        except BaseException:
            # Interrupted mid-step (Ctrl-C): the ranks are out of step with us now.
            self._fail(EngineDeadError(f"step {step} was interrupted; the engine must be "
                                       "rebuilt"), raise_it=False)
            raise
        result, self._result, self._step_in_flight = self._result, None, None
        self._last_step_end = time.time()
        return result.output

    def _staged(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step as broadcast: new requests' large arrays in the ranks' shared-memory
        ring (loom/ipc/shm_ring.py), the scheduler's objects left as they are."""
        ring = self._resources.mm_ring
        if ring is None or not any(new.mm_features for new in scheduler_output.scheduled_new_reqs):
            return scheduler_output
        return msgspec.structs.replace(scheduler_output, scheduled_new_reqs=[
            msgspec.structs.replace(new, mm_features=ring.stage(new.mm_features))
            if new.mm_features else new for new in scheduler_output.scheduled_new_reqs])

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, args: tuple = ()) -> list[Any]:
        """Broadcast a WorkerRPC and wait for every rank's RPCResult. Ranks run it from
        their event loop, between steps; a rank that dies meanwhile fails it as a step
        would, and one that has not answered after ``timeout_s`` (default: the
        watchdog's timeout and the start-up timeout together, a reload being a load) is
        hung."""
        if self._dead is not None:
            raise self._dead
        parallel = self.config.parallel
        if timeout_s is None:
            timeout_s = parallel.watchdog_timeout_s + parallel.worker_start_timeout_s
        call_id = next(self._rpc_ids)
        self._rpc_in_flight, self._rpc_results = call_id, {}
        deadline = time.monotonic() + timeout_s
        try:
            self.queue.broadcast(WorkerRPC(call_id=call_id, method=method, kwargs=kwargs or {},
                                           args=list(args)))
            while len(self._rpc_results) < parallel.world_size:
                self._receive(timeout_ms=int(HEALTH_CHECK_INTERVAL_S * 1000),
                              during=f"collective_rpc {method}")
                self._check_processes(during=f"collective_rpc {method}")
                if time.monotonic() > deadline:
                    waiting = sorted(set(range(parallel.world_size)) - set(self._rpc_results))
                    self._hang(f"collective_rpc {method} has run for {timeout_s:.0f}s without "
                               f"an answer from ranks {waiting}", ranks=waiting)
        except EngineDeadError:
            raise
        except BaseException:
            self._fail(EngineDeadError(f"collective_rpc {method} was interrupted; the engine "
                                       "must be rebuilt"), raise_it=False)
            raise
        finally:
            self._rpc_in_flight = None
            self._last_step_end = time.time()  # a long call is not a silent idle loop
        results = [self._rpc_results[rank] for rank in range(parallel.world_size)]
        for result in results:
            if result.error is not None:
                raise rpc_error(method, result.rank, result.exc_type, result.error)
        return [result.result for result in results]

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` if a rank exited or failed, ``WorkerHungError`` if it
        makes no progress (see the module's docstring). Cheap; a server polls it while
        idle, and ``execute_model`` while it waits."""
        if self._dead is not None:
            raise self._dead
        self._last_health_check = time.monotonic()
        self._receive(timeout_ms=0)
        self._check_processes(during="serving")
        self._check_progress()

    def _check_progress(self) -> None:
        parallel = self.config.parallel
        if self._step_in_flight is not None:
            elapsed = time.monotonic() - self._step_sent
            if elapsed > self._step_bound_s:
                self._hang(
                    f"step {self._step_in_flight} ({self._step_tokens} tokens) has run for "
                    f"{elapsed:.1f}s, past its bound of {self._step_bound_s:.1f}s "
                    f"(--watchdog-timeout {parallel.watchdog_timeout_s:g}s + 20 ms a token"
                    + (f" + 80 ms for each of {self._step_encoder_tokens} image tokens"
                       if self._step_encoder_tokens else "") + ")")
            return
        now = time.time()
        timeout = parallel.worker_health_timeout_s
        for rank, beat in enumerate(self.signals.heartbeat):
            silent = now - max(float(beat), self._last_step_end)
            if silent > timeout:
                self._hang(f"worker rank {rank}'s event loop has not run for {silent:.0f}s "
                           f"while idle (worker_health_timeout_s={timeout:g}); it is hung or "
                           "its host is gone", ranks=[rank])

    def _hang(self, message: str, ranks: list[int] | None = None) -> None:
        """Log every rank's state and the hung local ranks' stacks, kill them all, raise."""
        now = time.time()
        states = []
        for rank in range(self.config.parallel.world_size):
            started = float(self.signals.step_started[rank])
            step = int(self.signals.step[rank])
            states.append(f"rank {rank}: in step {step} for {now - started:.1f}s" if started
                          else f"rank {rank}: idle after step {step}")
        if ranks is None:  # the ranks still inside the step in flight (all, if none is)
            ranks = [rank for rank in range(self.config.parallel.world_size)
                     if self.signals.step_started[rank]] or list(
                         range(self.config.parallel.world_size))
        logger.error("hang: %s; %s. Stacks of the hung local ranks follow.", message,
                     "; ".join(states))
        for rank, process in enumerate(self._resources.processes):
            if rank in ranks and process.is_alive():
                self._dump_stacks(rank, process)
        time.sleep(STACK_DUMP_WAIT_S)
        if self.config.parallel.experts_across_replicas:
            message += ("; its MoE layers' all-to-alls wait for every data-parallel replica's "
                        "ranks, so the rank holding it up may be another replica's")
        error = WorkerHungError(f"worker rank {ranks[0]} is hung: {message}", rank=ranks[0])
        self._dead = error
        self._resources.release(grace_s=0.0)
        raise error

    def _receive(self, timeout_ms: int, during: str = "serving") -> None:
        """Handle every message that is there, waiting up to ``timeout_ms`` for the first:
        a status lands in the signals, a failure raises, a step result is kept in
        ``_result`` for the step in flight."""
        message = self.queue.poll(timeout_ms)
        while message is not None:
            if isinstance(message, RemoteStatus):
                for name in ("loaded", "ready", "profiled_blocks", "kv_cache_bytes_per_block",
                             "kv_cache_window", "kv_cache_num_groups",
                             "kv_cache_num_full_groups", "step", "step_started",
                             "weights_status"):
                    getattr(self.signals, name)[message.rank] = getattr(message, name)
                self.signals.heartbeat[message.rank] = time.time()  # our clock, not theirs
            elif isinstance(message, WorkerFailure):
                self._raise_failure(message, during)
            elif (isinstance(message, StepResult) and message.step == self._step_in_flight
                    and self._result is None):
                self._result = message
            elif (isinstance(message, RPCResult) and message.call_id == self._rpc_in_flight
                    and message.rank not in self._rpc_results):
                self._rpc_results[message.rank] = message
            else:
                waiting = (f"step {self._step_in_flight}" if self._step_in_flight is not None
                           else "no step")
                self._fail(EngineDeadError(
                    f"the task queue delivered an unexpected {type(message).__name__} "
                    f"(step {getattr(message, 'step', '?')}) while waiting for {waiting}",
                ), cause=UnexpectedMessageError(repr(message)[:200]))
            message = self.queue.poll(0)

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
                        f"worker rank {rank} {self._describe_death(process, during)}",
                        rank=rank, exitcode=process.exitcode))
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
                f"worker rank {rank} {self._describe_death(process, during)}", rank=rank,
                exitcode=process.exitcode))

    def _describe_death(self, process, during: str) -> str:
        """What follows "worker rank N" in the error of a rank that died."""
        return (f"(pid {process.pid}) died during {during} with "
                f"{_describe_exit(process.exitcode)}")

    def _dump_stacks(self, rank: int, process) -> None:
        """Have a hung rank write every thread's stack to its stderr (faulthandler)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGUSR1)

    def _fail(self, error: Exception, raise_it: bool = True,
              cause: BaseException | None = None) -> None:
        if isinstance(error, EngineDeadError):
            self._dead = error
        self.shutdown()
        if raise_it:
            raise error from cause

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
        return list(WorkerSignals.names(self.instance_id, os.getpid()).values())


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
