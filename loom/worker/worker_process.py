"""One rank's process, in the seed's order (``run_worker_proc``):

    init_distributed -> init_device -> load_model (loaded) -> initialize_kv_cache
    (profile, MIN over ranks, profiled_blocks) -> warm_up -> report_ready (ready)
    -> event_loop (heartbeat every iteration, step and its start time around each
    step) -> on WorkerShutdown: tear_down (ranks leave the process group in order, rank 0
    last) -> exit 0

A worker only executes: it never decides. Any failure is reported to the engine as
a ``WorkerFailure`` and ends the process with status 1. A worker whose parent died
(the engine, or ``loom worker`` on another host) cleans up after it and exits.

On the engine's host a rank writes the shared-memory ``WorkerSignals``; on another
host it sends the same facts as ``RemoteStatus`` messages over the task queue. Only
the event loop writes them, never a helper thread: a beat means the loop runs, and
the engine judges from the step a rank is in, and since when, whether it progresses.
SIGUSR1 makes the process write every thread's stack to stderr (the engine sends it
to a rank it judges hung). A Ray actor runs the same life cycle (``run_worker``, in
loom.executor.ray_executor), which then returns its exit status to the actor.

Test hook, read once here at the process's entry: ``LOOM_TEST_STALL_WORKER_AT_STEP=N``
makes every rank's event loop block forever on step N, as a deadlocked collective or
an endless kernel would, while the process lives.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from loom.config import EngineConfig
from loom.core.kv_sizing import cap_num_blocks, check_num_blocks
from loom.core.wire import (RemoteStatus, RPCResult, StepResult, WorkerFailure, WorkerRPC,
                            WorkerShutdown)
from loom.envs import settings
from loom.handshake import node_settings
from loom.ipc.debris import die_with_parent
from loom.ipc.shm_ring import FeatureFetcher
from loom.ipc.signal import WorkerSignals, unlink_segment
from loom.ipc.task_queue import TaskQueueAddresses, TaskQueueClient

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5  # the event loop wakes at least this often when idle
REMOTE_STATUS_INTERVAL_S = 1.0
COLLECTIVE_TIMEOUT_MARGIN_S = 10.0  # see limit_collective_waits
# Each of teardown's two waits for the other ranks; both well within the executor's
# SHUTDOWN_GRACE_S, after which it kills the workers.
TEARDOWN_WAIT_S = 2.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start; handed to the spawned process."""

    config: EngineConfig
    rank: int
    instance_id: str
    addresses: TaskQueueAddresses
    master_addr: str
    master_port: int
    parent_pid: int  # the engine's (owner of the signals), or `loom worker`'s
    local: bool  # on the engine's host: write the shared-memory signals
    log_level: str = "WARNING"  # the engine's, so workers log as it does
    # A Ray actor (loom.executor.ray_executor): its parent is a raylet, not parent_pid,
    # and Ray ends it with its owner, the engine; so no parent watch, and run_worker
    # returns to the actor instead of ending the process.
    in_ray_actor: bool = False
    ranks_on_host: int | None = None  # Ray: ranks placed on this host; None: threads_per_rank


class StatusReporter:
    """Writes this rank's signals: shared memory locally, messages from another host."""

    def __init__(self, spec: WorkerSpec, queue: TaskQueueClient) -> None:
        self.rank = spec.rank
        self.queue = queue
        self.signals = (WorkerSignals.attach(spec.instance_id, spec.config.parallel.world_size,
                                             owner_pid=spec.parent_pid)
                        if spec.local else None)
        self.loaded = self.ready = False
        self.profiled_blocks = self.kv_cache_bytes_per_block = self.kv_cache_window = 0
        self.kv_cache_num_groups = self.kv_cache_num_full_groups = 1
        self.step = 0
        self.step_started = 0.0
        self.weights_status = 0
        self._last_sent = 0.0

    def set(self, **facts) -> None:
        for name, value in facts.items():
            setattr(self, name, value)
            if self.signals is not None:
                getattr(self.signals, name)[self.rank] = value
        self.beat(force=True)

    def beat(self, force: bool = False) -> None:
        now = time.time()
        if self.signals is not None:
            self.signals.heartbeat[self.rank] = now
        elif force or now - self._last_sent >= REMOTE_STATUS_INTERVAL_S:
            self.queue.send(RemoteStatus(
                rank=self.rank, loaded=self.loaded, ready=self.ready,
                profiled_blocks=self.profiled_blocks, heartbeat=now, step=self.step,
                step_started=self.step_started,
                kv_cache_bytes_per_block=self.kv_cache_bytes_per_block,
                kv_cache_window=self.kv_cache_window,
                kv_cache_num_groups=self.kv_cache_num_groups,
                kv_cache_num_full_groups=self.kv_cache_num_full_groups,
                weights_status=self.weights_status))
            self._last_sent = now

    def begin_step(self, step: int) -> None:
        """Locally two stores; a remote rank tells the engine at its next beat."""
        self.step, self.step_started = step, time.time()
        if self.signals is not None:
            self.signals.step[self.rank] = step
            self.signals.step_started[self.rank] = self.step_started

    def end_step(self) -> None:
        self.step_started = 0.0
        if self.signals is not None:
            self.signals.step_started[self.rank] = 0.0

    def close(self) -> None:
        if self.signals is not None:
            self.signals.close()


# ----------------------------------------------------------------- the life cycle


def run_worker_proc(spec: WorkerSpec) -> None:
    """The spawned process's target."""
    configure_process(spec)
    _exit(run_worker(spec))


def run_worker(spec: WorkerSpec) -> int:
    """The life cycle, in a process ``configure_process`` has set up; returns the exit
    status: 0 after a shutdown, 1 after a failure (reported to the engine first)."""
    stall_at_step = settings().test_stall_worker_at_step
    queue = TaskQueueClient(spec.addresses)
    status = worker = None
    exit_code = 0
    try:
        status = StatusReporter(spec, queue)
        started = time.monotonic()
        tp_group = init_distributed(spec)
        check_nodes_agree(spec)
        worker = init_device(spec, tp_group)
        # Each rank writes its own weights_status as an update moves it (weight_updates.py).
        worker.weights.on_status = lambda state: status.set(weights_status=int(state))
        load_model(worker, status)
        loaded = time.monotonic()
        num_blocks = initialize_kv_cache(worker, status)
        profiled = time.monotonic()
        warm_up(worker)
        limit_collective_waits(spec)
        report_ready(status)
        logger.info("rank %d ready: loaded in %.1fs, profiled and allocated %d KV blocks in "
                    "%.1fs, warmed up in %.1fs", spec.rank, loaded - started, num_blocks,
                    profiled - loaded, time.monotonic() - profiled)
        event_loop(worker, queue, status, spec, stall_at_step)
    except BaseException as exc:  # report anything, even a KeyboardInterrupt, then exit 1
        exit_code = 1
        logger.error("worker rank %d failed: %s: %s", spec.rank, type(exc).__name__, exc)
        try:
            queue.send(WorkerFailure(rank=spec.rank, error=f"{type(exc).__name__}: {exc}",
                                     exc_type=type(exc).__name__,
                                     traceback=traceback.format_exc()))
        except Exception:
            pass
    finally:
        if worker is not None:
            worker.shutdown_kv_connector()  # its listener, and its shared-memory cache
            worker.shutdown_kv_tier()  # its file
        tear_down(status, queue, clean=exit_code == 0)
    return exit_code


def init_distributed(spec: WorkerSpec):
    from loom.distributed.parallel_state import init_distributed as join_group

    parallel = spec.config.parallel
    if parallel.experts_across_replicas:  # one group over every replica's ranks
        from loom.distributed.parallel_state import init_across_replicas

        return init_across_replicas(spec.rank, parallel.tensor_parallel_size,
                                    parallel.data_parallel_rank, parallel.data_parallel_size,
                                    parallel.data_parallel_address,
                                    parallel.data_parallel_master_port, spec.config.device,
                                    timeout_s=parallel.worker_start_timeout_s)
    return join_group(spec.rank, parallel.world_size, spec.master_addr, spec.master_port,
                      spec.config.device, timeout_s=parallel.worker_start_timeout_s)


def check_nodes_agree(spec: WorkerSpec) -> None:
    """A `loom worker` node builds its config from its own flags: a rank whose settings
    differ from rank 0's (another --quantization, dtype or model) fails here, naming the
    flags, instead of holding other weights than its peers expect."""
    from loom.distributed.parallel_state import rank0_value

    if spec.config.parallel.nnodes == 1:
        return
    mine = node_settings(spec.config)
    head = json.loads(rank0_value("loom/node-settings", json.dumps(mine, default=str)))
    mine = json.loads(json.dumps(mine, default=str))
    differences = [f"{name} is {mine.get(name)!r} here, {value!r} on node 0"
                   for name, value in head.items() if mine.get(name) != value]
    if differences:
        raise ValueError(f"node {spec.config.parallel.node_rank}'s settings differ from "
                         f"node 0's: {'; '.join(differences)}; start `loom worker` with "
                         f"node 0's flags")


def init_device(spec: WorkerSpec, tp_group):
    from loom.worker.worker import Worker

    worker = Worker(spec.config, spec.rank, tp_group)
    worker.init_device()
    return worker


def load_model(worker, status: StatusReporter) -> None:
    worker.load_model()
    worker.tp_group.barrier()
    status.set(loaded=True)


def initialize_kv_cache(worker, status: StatusReporter) -> int:
    """Profile, publish the block count every rank can hold and the bytes of a block,
    allocate (capped) blocks."""
    profiled_blocks = worker.determine_num_blocks()  # the same on every rank: MIN-reduced
    runner = worker.model_runner
    bytes_per_block = runner.kv_cache_bytes_per_block
    num_groups, num_full_groups = runner.kv_cache_group_counts
    status.set(profiled_blocks=profiled_blocks, kv_cache_bytes_per_block=bytes_per_block,
               kv_cache_window=runner.kv_cache_window, kv_cache_num_groups=num_groups,
               kv_cache_num_full_groups=num_full_groups)
    groups = runner.kv_cache_groups.windows
    num_blocks = cap_num_blocks(worker.config, profiled_blocks, groups)
    check_num_blocks(worker.config, num_blocks, bytes_per_block, groups)
    worker.initialize_kv_cache(num_blocks)
    return num_blocks


def warm_up(worker) -> None:
    worker.warm_up()


def limit_collective_waits(spec: WorkerSpec) -> None:
    """Collectives may wait as long as the largest step may run, and a little more: the
    engine judges a hang first (with stacks); a rank whose peer hangs then fails too
    instead of waiting out the start-up timeout (15 minutes)."""
    from loom.distributed.parallel_state import set_collective_timeout

    config = spec.config
    set_collective_timeout(config.largest_step_bound_s() + COLLECTIVE_TIMEOUT_MARGIN_S)


def report_ready(status: StatusReporter) -> None:
    status.set(ready=True)


def event_loop(worker, queue: TaskQueueClient, status: StatusReporter, spec: WorkerSpec,
               stall_at_step: int | None = None) -> None:
    """Block on the task queue; wake at least every HEARTBEAT_INTERVAL_S to beat and
    to notice a dead parent. Returns on WorkerShutdown."""
    timeout_ms = int(HEARTBEAT_INTERVAL_S * 1000)
    is_rank0 = spec.rank == 0
    mm_fetcher = FeatureFetcher(index=spec.rank)  # the engine's ring, when it sends one
    while True:
        status.beat()
        message = queue.poll(timeout_ms)
        if message is None:
            if not spec.in_ray_actor and os.getppid() != spec.parent_pid:
                logger.warning("worker rank %d: parent %d is gone; exiting", spec.rank,
                               spec.parent_pid)
                _clean_up_after_dead_parent(spec)
                return
            continue
        if isinstance(message, WorkerShutdown):
            return
        if isinstance(message, WorkerRPC):
            queue.send(run_rpc(worker, message, spec.rank))
            continue
        status.begin_step(message.step)
        if message.step == stall_at_step:
            _stall_forever(spec.rank, message.step)
        for new in message.scheduler_output.scheduled_new_reqs:
            if new.mm_features:
                mm_fetcher.fetch(new.mm_features)
        output = worker.execute_model(message.scheduler_output)
        status.end_step()
        if is_rank0:
            queue.send(StepResult(step=message.step, output=output))


def run_rpc(worker, message: WorkerRPC, rank: int) -> RPCResult:
    """``worker.<method>(**kwargs)``; an exception is this rank's answer, not its end (a
    refused weight update leaves the rank serving the weights it had)."""
    try:
        if message.method.startswith("_") or not callable(getattr(worker, message.method, None)):
            raise ValueError(f"the worker has no method {message.method!r}")
        result = getattr(worker, message.method)(*message.args, **message.kwargs)
        return RPCResult(call_id=message.call_id, rank=rank, result=result)
    except Exception as exc:
        logger.warning("worker rank %d: %s failed: %s: %s", rank, message.method,
                       type(exc).__name__, exc)
        return RPCResult(call_id=message.call_id, rank=rank, error=f"{exc}",
                         exc_type=type(exc).__name__)


def _stall_forever(rank: int, step: int) -> None:
    """LOOM_TEST_STALL_WORKER_AT_STEP: a live process whose loop never comes back."""
    logger.warning("worker rank %d: stalling in step %d (LOOM_TEST_STALL_WORKER_AT_STEP)",
                   rank, step)
    threading.Event().wait()


def tear_down(status: StatusReporter | None, queue: TaskQueueClient, clean: bool) -> None:
    """Leave the process group (after a clean stop in order, rank 0 last, see
    ``destroy_distributed``), then close the signals and the queue. Errors are
    logged, never raised: teardown must not turn a clean stop into a failure."""
    from loom.distributed.parallel_state import destroy_distributed

    destroy_distributed(timeout_s=TEARDOWN_WAIT_S if clean else 0.0)
    for close in ([status.close] if status is not None else []) + [queue.close]:
        try:
            close()
        except Exception as exc:
            logger.warning("worker teardown: %s failed: %s: %s", close.__qualname__,
                           type(exc).__name__, exc)


def _exit(exit_code: int) -> None:
    """Exit without interpreter finalisation. Everything is closed by now; what
    finalisation would still run (destructors of torch.distributed's C++ objects, in
    no set order) must not turn a clean exit into an abort and a core dump."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# ----------------------------------------------------------------- helpers


def configure_process(spec: WorkerSpec) -> None:
    # Ctrl-C reaches the whole process group; the engine decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the engine asks for stacks
    if spec.local and not spec.in_ray_actor:
        die_with_parent()  # a hung rank is killed with the engine (remote: run_node kills)
    logging.basicConfig(level=logging.getLevelName(spec.log_level),
                        format=f"%(asctime)s loom-worker-{spec.rank} %(levelname)s %(message)s")
    if spec.config.device == "cpu":
        import torch

        from loom.worker.memory import keep_freed_memory

        keep_freed_memory()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        parallel = spec.config.parallel
        if spec.ranks_on_host is not None and parallel.cpu_threads_per_rank is None:
            threads = max(1, (cores or 1) // spec.ranks_on_host)  # Ray: ranks placed here
        else:
            threads = parallel.threads_per_rank(cores or 1)
        torch.set_num_threads(threads)
        logger.info("rank %d of data-parallel replica %d: %d torch threads on %d cores",
                    spec.rank, parallel.data_parallel_rank, torch.get_num_threads(),
                    cores or 1)


def _clean_up_after_dead_parent(spec: WorkerSpec) -> None:
    """The engine died without shutting down (SIGKILL): remove what it owned."""
    if not spec.local:
        return
    for name in WorkerSignals.names(spec.instance_id, spec.parent_pid).values():
        unlink_segment(name)
    for address in (spec.addresses.broadcast, spec.addresses.results):
        if address.startswith("ipc://"):
            shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


# ----------------------------------------------------------------- `loom worker`


def run_node(config: EngineConfig) -> int:
    """Run node ``node_rank``'s ranks for an engine on node 0 (``loom worker``).

    Spawns the ranks, which join the engine's process group and task queue on
    master_addr, and waits for them. SIGTERM/SIGINT stop them. Returns the first
    non-zero exit status of a rank, or 0 when the engine shut them down.
    """
    import multiprocessing

    parallel = config.parallel
    if parallel.nnodes == 1 or parallel.node_rank == 0:
        raise ValueError("`loom worker` runs the ranks of a node other than 0; give "
                         "--nnodes > 1 and --node-rank >= 1 (node 0 runs the engine)")
    addresses = TaskQueueAddresses.tcp(parallel.master_addr, parallel.master_port)
    context = multiprocessing.get_context("spawn")
    first_rank = parallel.node_rank * parallel.ranks_per_node
    processes = []
    for rank in range(first_rank, first_rank + parallel.ranks_per_node):
        spec = WorkerSpec(config=config, rank=rank, instance_id=f"node{parallel.node_rank}",
                          addresses=addresses, master_addr=parallel.master_addr,
                          master_port=parallel.master_port, parent_pid=os.getpid(), local=False)
        process = context.Process(target=run_worker_proc, args=(spec,), daemon=True,
                                  name=f"loom-worker-{rank}")
        process.start()
        processes.append(process)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            for process in processes:
                process.join(0.5)
                if process.exitcode not in (None, 0):
                    logger.error("rank process %s exited with %s", process.name,
                                 process.exitcode)
                    return 1
            if all(process.exitcode == 0 for process in processes):
                return 0
    except (KeyboardInterrupt, SystemExit):
        return 130
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(2.0)
