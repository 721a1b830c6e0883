"""The engine core in its own process, driven over ZMQ with msgspec messages.

    API server ── PUSH ─▶ EngineCoreInput  (add / abort / finish / shutdown)  ─▶ PULL ┐
               ◀─ PULL ── EngineCoreMessage (ready / outputs+stats / failed) ◀─ PUSH ┘ core

This module is the core's side. The API process's side, ``EngineCoreClient``
(``loom/ipc/engine_core_client.py``), starts this process and binds both sockets;
the core connects. The core's loop: take every pending input, step while there is
work, and block on the input socket when there is none (waking every
``_HEALTH_CHECK_INTERVAL_S`` only to check the workers and that its parent lives). Every iteration that did anything sends one
``EngineCoreOutputs`` batch carrying the scheduler's stats, so the API side's
gauges follow aborts too. An exception in a step is fatal: the core sends
``EngineCoreFailed`` and exits non-zero; the API side fails every request.

The API process judges the core's progress (``AsyncLLM``): with requests in flight,
one ``EngineCoreOutputs`` must arrive within ``core_step_bound_s``, else the core is
hung. SIGUSR1 makes the core write every thread's stack to stderr first. Test hook,
read once at the process's entry: ``LOOM_TEST_STALL_ENGINE_AT_STEP=N`` blocks the
core's loop forever before its N-th step.

Importing this module imports no torch: the executor is built once the process runs,
and only an in-process worker (one rank) brings torch into it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
import traceback
from collections import deque

import msgspec
import zmq

from loom.config import EngineConfig
from loom.core.wire import (AbortRequests, ControlRequest, ControlResponse, EngineCoreFailed,
                            EngineCoreInput, EngineCoreMessage, EngineCoreOutput,
                            EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
                            FinishRequests, PauseGeneration)
from loom.errors import EngineDeadError
from loom.envs import settings
from loom.ipc.debris import die_with_parent
from loom.ipc.shm_ring import FeatureFetcher, StaleSlotError
from loom.request import Request, RequestStatus
from loom.torch_free import forbid_torch

logger = logging.getLogger(__name__)

_HEALTH_CHECK_INTERVAL_S = 1.0
_TRANSFER_WAIT_S = 0.1  # the longest an engine waiting only for K/V goes without a beat
# What the API process adds to a step's bound for the core's own work and for the
# core to notice a hung worker, kill it and report (MultiProcExecutor._hang).
CORE_WATCHDOG_MARGIN_S = 5.0


def core_step_bound_s(config: EngineConfig) -> float:
    """The longest the engine core may go without finishing a step while requests wait:
    the bound of the largest step the scheduler may make, plus the margin."""
    return config.largest_step_bound_s() + CORE_WATCHDOG_MARGIN_S


# ----------------------------------------------------------------- the child side

class EngineCoreProc:
    """Runs ``EngineCore`` in this process, fed and read over the two sockets."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 stall_at_step: int | None = None) -> None:
        self.stall_at_step = stall_at_step
        self.num_steps = 0
        self.context = zmq.Context()
        self.output_socket = self.context.socket(zmq.PUSH)
        self.output_socket.connect(output_address)
        self.input_socket = self.context.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        self.parent_pid = os.getppid()
        self.should_shutdown = False
        self.controls: deque[ControlRequest] = deque()
        self.mm_fetcher = FeatureFetcher(index=0)
        self.engine_core = _make_engine_core(config)
        # Experts across data-parallel replicas: the replicas' cores step together.
        self.lockstep = None
        if config.parallel.experts_across_replicas:
            from loom.core.dp_lockstep import DPLockstep

            self.lockstep = DPLockstep(config, core_step_bound_s(config))
        self._send(EngineCoreReady(num_blocks=self.engine_core.num_blocks))

    def run(self) -> None:
        while not self.should_shutdown:
            if not self.engine_core.has_unfinished_requests() and not self.controls:
                self._wait_for_input()
            self._process_inputs()
            if self.should_shutdown:
                break
            self._run_controls()
            if self.lockstep is not None and not self.lockstep.agree(
                    self.engine_core.has_unfinished_requests(), self._check_while_waiting):
                self._take_kv_reports()
                continue  # no replica has work: all wait
            self.num_steps += 1
            if self.num_steps == self.stall_at_step:
                logger.warning("engine core: stalling before step %d "
                               "(LOOM_TEST_STALL_ENGINE_AT_STEP)", self.num_steps)
                threading.Event().wait()
            had_work = self.engine_core.has_unfinished_requests()
            held = self.engine_core.kv_transfer_stats
            outputs = self.engine_core.step(lockstep=self.lockstep is not None)
            # not after a dummy step, unless it took transfer reports (freed held blocks)
            if outputs or had_work or self.lockstep is None or \
                    self.engine_core.kv_transfer_stats != held:
                self._send(EngineCoreOutputs(outputs, self.engine_core.get_stats(), time.time()))
            if not outputs and self.engine_core.scheduler.only_loading and not self.controls:
                self._wait_for_transfers()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        self.mm_fetcher.close()
        if self.lockstep is not None:
            self.lockstep.close()
        self.context.destroy(linger=1000)

    def _take_kv_reports(self) -> None:
        """No replica steps this round, but the ranks' transfer reports are taken all the
        same: on a prefill replica the last send of a finished request frees its held
        blocks here (a step only takes them when some replica has work, and the report
        left unread would wake ``_wait_for_input`` at once, round after round). A decode
        replica pulling blocks has work (its request is unfinished), so it steps."""
        core = self.engine_core
        if core.kv_events is not None:  # (the stats too: the API side's gauges follow)
            self._send(EngineCoreOutputs(core.poll_kv_transfers(), core.get_stats(),
                                         time.time()))

    def _check_while_waiting(self) -> None:
        """While the peers' step flags are awaited: the workers, the parent, and a
        shutdown sent meanwhile (the peers may be gone for good)."""
        if os.getppid() != self.parent_pid:
            raise EngineDeadError("the API server process is gone")
        self.engine_core.executor.check_health()
        if self.input_socket.poll(0):
            self._process_inputs()
            if self.should_shutdown:
                raise _ShutdownWhileWaiting()

    def _wait_for_input(self) -> None:
        """Block until a message arrives; meanwhile check the workers and the parent.
        With a KV connector, a rank's transfer report (or a held transfer's deadline)
        ends the wait too: the step that follows frees what it releases."""
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        kv_events = self.engine_core.kv_events
        if kv_events is not None:
            poller.register(kv_events.socket, zmq.POLLIN)
        if self.lockstep is not None:  # a peer that starts a round wakes this core
            if self.lockstep.has_news:
                return
            poller.register(self.lockstep.inbox, zmq.POLLIN)
        while not poller.poll(_HEALTH_CHECK_INTERVAL_S * 1000):
            if os.getppid() != self.parent_pid:
                logger.error("the API server process is gone; engine core exiting")
                self.should_shutdown = True
                return
            self.engine_core.executor.check_health()
            if kv_events is not None and self.engine_core.scheduler.kv_transfer.expire_holds():
                return

    def _wait_for_transfers(self) -> None:
        """Every request waits for its K/V: sleep until a report or an input arrives."""
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.engine_core.kv_events.socket, zmq.POLLIN)
        poller.poll(_TRANSFER_WAIT_S * 1000)

    def _process_inputs(self) -> None:
        core = self.engine_core
        while self.input_socket.poll(0):
            message = self.decoder.decode(self.input_socket.recv(copy=False))
            if isinstance(message, EngineCoreRequest):
                self._add_request(message)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, FinishRequests):
                for request_id, stop in message.stops:
                    core.finish_by_stop_string(request_id, stop)
            elif isinstance(message, ControlRequest):
                self.controls.append(message)
            else:
                self.should_shutdown = True

    def _run_controls(self) -> None:
        """Answer the control calls in order. One that waits for the requests in flight
        (``EngineCore.ready_for``) stays first in line while the engine steps."""
        while self.controls and self.engine_core.ready_for(self.controls[0].control):
            self._send(self._run_control(self.controls.popleft()))

    def _run_control(self, request: ControlRequest) -> ControlResponse:
        core = self.engine_core
        name = request.control.__struct_config__.tag
        try:
            result = core.run_control(request.control)
        except EngineDeadError:
            raise  # fatal: the loop's caller reports it
        except Exception as error:  # noqa: BLE001 — the caller's answer; the engine serves on
            logger.warning("control %s failed: %s: %s", name, type(error).__name__, error)
            return ControlResponse(request.call_id, error=str(error),
                                   exc_type=type(error).__name__, holding=core.is_holding)
        if isinstance(request.control, PauseGeneration):  # the aborted requests' last outputs
            self._send(EngineCoreOutputs(result, core.get_stats(), time.time()))
            result = None
        return ControlResponse(request.call_id, result=result, holding=core.is_holding)

    def _add_request(self, message: EngineCoreRequest) -> None:
        try:
            # Large arrays wait in the API process's shared-memory ring: taken at once,
            # so that its space is free again (loom/ipc/shm_ring.py).
            if message.mm_features:
                self.mm_fetcher.fetch(message.mm_features)
            self.engine_core.add_request(Request(
                message.request_id, message.prompt_token_ids, message.sampling_params,
                frozenset(message.eos_token_ids), arrival_time=message.arrival_time,
                parent_request_id=message.parent_request_id, index=message.index,
                mm_features=message.mm_features))
        except (ValueError, StaleSlotError) as error:  # a bug on the API side; a ring too small
            self._send(EngineCoreOutputs(
                [EngineCoreOutput(req_id=message.request_id, new_token_ids=[],
                                  finish_reason=RequestStatus.FINISHED_ERROR.finish_reason.value,
                                  stop_reason=str(error))],
                self.engine_core.get_stats(), time.time()))

    def _send(self, message: EngineCoreMessage) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)


class _ShutdownWhileWaiting(Exception):
    """EngineCoreShutdown arrived while the peers' step flags were awaited."""


def _make_engine_core(config: EngineConfig):
    from loom.core.engine_core import EngineCore

    # Worker processes or an in-process worker, as config.parallel says.
    return EngineCore.from_config(config)


def run_engine_core(config_msgpack: bytes, input_address: str, output_address: str) -> None:
    """The child process's entry point. Exits 1 after reporting any failure.

    The config arrives as msgpack (it is a tree of frozen dataclasses), not pickled.
    """
    config = msgspec.msgpack.decode(config_msgpack, type=EngineConfig)
    parallel = config.parallel
    if parallel.use_worker_processes and parallel.distributed_executor_backend != "ray" \
            and not config.structured_outputs.may_use_xgrammar:
        # The ranks hold torch. This process schedules, and tokenizes only to compile
        # grammars: with transformers in its mode without torch (loom/torch_free.py).
        # xgrammar imports torch: where it may serve a request, this process holds
        # torch from its first constrained request on (docs/structured_outputs.md).
        forbid_torch()
    # The API server owns shutdown (it drains on SIGTERM, then sends EngineCoreShutdown), so a
    # signal sent to the whole process group must not kill the core under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the API process asks for stacks
    stall_at_step = settings().test_stall_engine_at_step
    if config.device == "cpu" and not config.parallel.use_worker_processes:
        from loom.worker.memory import keep_freed_memory

        keep_freed_memory()  # the worker runs in this process (UniProcExecutor)
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    proc = None
    try:
        proc = EngineCoreProc(config, input_address, output_address, stall_at_step)
        proc.run()
    except _ShutdownWhileWaiting:
        pass
    except BaseException as error:  # noqa: BLE001 — reported to the API side, then exit 1
        message = f"engine core failed: {type(error).__name__}: {error}"
        logger.error("%s\n%s", message, traceback.format_exc())
        _report_failure(input_address, output_address, message, proc)
        os._exit(1)
    proc.shutdown()


def _report_failure(input_address: str, output_address: str, message: str,
                    proc: EngineCoreProc | None) -> None:
    try:
        if proc is None:  # failed while loading: no socket yet
            context = zmq.Context()
            socket = context.socket(zmq.PUSH)
            socket.connect(output_address)
        else:
            context, socket = proc.context, proc.output_socket
        socket.send(msgspec.msgpack.encode(EngineCoreFailed(message)))
        context.destroy(linger=2000)
    except Exception:  # noqa: BLE001 — the exit code still tells the parent
        pass
