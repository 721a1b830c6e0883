"""AsyncLLM: the API server's handle on an engine core running in its own process.

Input processing (validation) and output processing (detokenization, stop strings,
n > 1 fan-out) run here, in the server's event loop; the engine core runs in a child
process (``loom/core/engine_core_proc.py``), reached through an ``EngineCoreClient``
(``loom/ipc/engine_core_client.py``: the process and its sockets). One output-handler
task reads the core's messages and puts each ``RequestOutput`` into its request's
asyncio queue; the ``RequestStream`` that ``add_request`` returns reads that queue.
Closing the stream early (a client that disconnected, a cancelled task) aborts the
request in the core, freeing its KV blocks.

When the core process dies or reports a failed step, every request in flight gets an
``EngineDeadError`` and the ``on_dead`` callbacks run (the server answers 503 and exits).

A watchdog judges the core's progress, not its liveness: while requests are in
flight, a message from the core must arrive within ``core_step_bound_s`` (it sends
one after every step). Past that the core is hung: its stacks go to the log
(SIGUSR1, faulthandler), it is killed, and everything fails as if it had died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loom.config import EngineConfig
from loom.core.engine_core_proc import core_step_bound_s
from loom.core.wire import (AbortRequests, ControlRequest, ControlResponse, EngineCoreFailed,
                            EngineCoreInput, EngineCoreOutputs, EngineCoreRequest,
                            FinishRequests, MultiModalFeature, make_control)
from loom.errors import EngineDeadError
from loom.input_processor import InputProcessor
from loom.ipc.engine_core_client import EngineCoreClient
from loom.ipc.remote_engine_core import RemoteEngineCoreClient
from loom.metrics import ServerMetrics
from loom.output_processor import OutputProcessor
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests wait than --max-num-waiting allows; retry later."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (e.g. the shutdown timeout passed while draining)."""


class ControlError(RuntimeError):
    """A control call (``AsyncLLM.control``) failed in the engine core, which serves on;
    ``exc_type`` is the core's exception name (ValueError, FileNotFoundError: the
    caller's fault)."""

    def __init__(self, message: str, exc_type: str | None) -> None:
        super().__init__(message)
        self.exc_type = exc_type


@dataclass
class _TrackedRequest:
    queue: asyncio.Queue
    num_sequences: int
    lora_name: str | None = None


class RequestStream:
    """The RequestOutputs of one request, as an async iterator.

    Closing it (``aclose``), or cancelling the task that awaits it, before the last
    output aborts the request in the engine core.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.llm = llm
        self.request_id = request_id
        self._queue = queue
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, Exception):
            self._finished = True
            raise item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self._finished:
            self._finished = True
            self.llm.abort(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, max_num_waiting: int | None = None,
                 log_requests: bool = True, tokenizer: Tokenizer | None = None,
                 metrics: ServerMetrics | None = None,
                 core: EngineCoreClient | RemoteEngineCoreClient | None = None) -> None:
        """``tokenizer`` and ``metrics`` are given by a data-parallel server
        (``DPAsyncLLM``), whose replicas share one tokenizer and one registry; ``core``
        for a replica whose engine core runs on another host."""
        # the LoRA adapters served, by name, each with its load id (loom/lora.py;
        # SamplingParams.lora_id); the load/unload routes change it
        self.lora_names: dict[str, int] = {name: 0 for name, _ in config.model.lora_modules}
        self._lora_done = asyncio.Event()  # a request with an adapter finished
        self.config = config
        self.tokenizer: Tokenizer = tokenizer or load_tokenizer(
            config.model.model, config.model.tokenizer, config.model.chat_template)
        self.input_processor = InputProcessor(config.model, self.tokenizer,
                                              config.structured_outputs,
                                              config.scheduler.policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = metrics or ServerMetrics(config.model.name)
        self.max_num_waiting = max_num_waiting
        self.log_requests = log_requests
        self.dead_error: EngineDeadError | None = None
        self.on_dead: list[Callable[[], None]] = []
        # Called with a request's id once it is no longer in flight (finished, aborted,
        # failed): a data-parallel server's load count (DPAsyncLLM).
        self.on_request_done: list[Callable[[str], None]] = []
        self._eos_token_ids = list(self.tokenizer.eos_token_ids)
        self._requests: dict[str, _TrackedRequest] = {}
        self.metrics.server_requests_in_flight.set_function(lambda: len(self._requests))
        self._num_sequences = 0  # engine requests in flight, n per user request
        # A replica on another host (loom serve --headless): DPAsyncLLM gives its client.
        self._core = core or EngineCoreClient(config)
        self._output_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        # Progress: when the core last sent anything, and since when requests wait.
        self._last_core_message = time.monotonic()
        self._busy_since = time.monotonic()
        self._shutting_down = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Control calls awaiting the core's answer; while any is pending, or the core
        # holds new requests (paused or asleep, as its last answer said), requests may
        # legitimately wait: the watchdog does not judge.
        self._control_ids = itertools.count(1)
        self._controls: dict[int, asyncio.Future] = {}
        self._held = False

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> int:
        """Start the engine core process and wait until it can serve; returns its KV blocks."""
        num_blocks = await self._core.start()
        self._core.watch_exit(self._on_core_exit)
        self._output_task = asyncio.create_task(self._handle_outputs(), name="loom-outputs")
        self._watchdog_task = asyncio.create_task(self._watch_core(), name="loom-watchdog")
        return num_blocks

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (it finishes its current step) and close the sockets."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._core.unwatch_exit()
        for task in (self._output_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        await self._core.shutdown(timeout)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._requests)

    @property
    def replica_metrics(self) -> list[ServerMetrics]:
        """Each engine core's metrics (one here; one per replica in ``DPAsyncLLM``)."""
        return [self.metrics]

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = True,
                    mm_features: list[MultiModalFeature] | None = None) -> RequestStream:
        """Send a request to the engine core; its outputs come as deltas if ``stream``,
        else as one final RequestOutput.

        ``prompt_token_ids`` and ``params`` must have passed ``input_processor``.
        Raises QueueFullError or EngineDeadError at once; the stream raises
        EngineDeadError or RequestAbortedError if the request cannot finish.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if self.max_num_waiting is not None:
            # Sequences beyond what one batch can run have to wait.
            waiting = self._num_sequences + params.n - self.config.scheduler.max_num_seqs
            if waiting > self.max_num_waiting:
                raise QueueFullError(f"the server has {self._num_sequences} sequences in flight "
                                     f"and at most {self.max_num_waiting} may wait; retry later")
        engine_request_ids = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, stream)
        queue: asyncio.Queue = asyncio.Queue()
        self._requests[request_id] = _TrackedRequest(queue, params.n, params.lora_name)
        self._num_sequences += params.n
        if self._idle.is_set():
            self._busy_since = time.monotonic()
        self._idle.clear()
        now = time.time()
        for index, engine_request_id in enumerate(engine_request_ids):
            self.metrics.record_sequence_added(engine_request_id, len(prompt_token_ids), now)
            self._send(EngineCoreRequest(
                request_id=engine_request_id, prompt_token_ids=prompt_token_ids,
                sampling_params=params, eos_token_ids=self._eos_token_ids, arrival_time=now,
                parent_request_id=request_id, index=index, mm_features=mm_features or []))
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", request_id, len(prompt_token_ids),
                        params)
        return RequestStream(self, request_id, queue)

    async def control(self, method: str, /, **kwargs: Any) -> Any:
        """Run the control call ``method`` with ``kwargs`` (``wire.Control`` by its tag:
        pause_generation, resume_generation, update_weights, sleep, wake_up,
        reset_prefix_cache, collective_rpc, status) in the core process, between steps;
        returns its result. A pause in mode wait, an update and a sleep answer once the
        requests in flight have finished. Raises ControlError if it failed or no such
        call exists (the engine serves on), EngineDeadError if the engine died."""
        if self.dead_error is not None:
            raise self.dead_error
        try:
            control = make_control(method, kwargs)
        except ValueError as error:
            raise ControlError(str(error), "ValueError") from None
        call_id = next(self._control_ids)
        future = asyncio.get_running_loop().create_future()
        self._controls[call_id] = future
        self._send(ControlRequest(call_id, control))
        try:
            return await future  # the answer's handler forgets the call, even if cancelled
        finally:
            self._busy_since = time.monotonic()  # requests waited on the call, not a hang

    async def wait_until_lora_idle(self, name: str) -> None:
        """Return once no request with LoRA adapter ``name`` is in flight."""
        while self.lora_in_flight(name):
            self._lora_done.clear()
            await self._lora_done.wait()

    async def wait_until_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    def abort(self, request_id: str, reason: str | None = None) -> None:
        """Abort a request; with a ``reason``, its stream raises RequestAbortedError."""
        tracked = self._untrack(request_id)
        if tracked is None:
            return
        if reason is not None:
            tracked.queue.put_nowait(RequestAbortedError(reason))
        engine_request_ids = self.output_processor.abort_request(request_id)
        for engine_request_id in engine_request_ids:
            self.metrics.forget_sequence(engine_request_id)
        if engine_request_ids and not self.is_dead:
            self._send(AbortRequests(engine_request_ids))
        if self.log_requests:
            logger.info("aborted request %s", request_id)

    def abort_all(self, reason: str) -> None:
        for request_id in list(self._requests):
            self.abort(request_id, reason)

    def lora_in_flight(self, name: str) -> bool:
        """Whether a request running with LoRA adapter ``name`` is in flight."""
        return any(tracked.lora_name == name for tracked in self._requests.values())

    def _untrack(self, request_id: str) -> _TrackedRequest | None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._num_sequences -= tracked.num_sequences
            if not self._requests:
                self._idle.set()
            if tracked.lora_name is not None:
                self._lora_done.set()
            for callback in self.on_request_done:
                callback(request_id)
        return tracked

    # ----------------------------------------------------------------- outputs

    async def _handle_outputs(self) -> None:
        try:
            while True:
                message = await self._core.receive()
                self._last_core_message = time.monotonic()
                if isinstance(message, EngineCoreFailed):
                    self._fail(message.message)
                    return
                if isinstance(message, ControlResponse):
                    self._answer_control(message)
                    continue
                if not isinstance(message, EngineCoreOutputs):
                    self._fail(f"the engine core sent {type(message).__name__} out of turn")
                    return
                self._process_outputs(message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 — a bug here must not hang every client
            logger.exception("output handler failed")
            self._fail(f"the server's output handler failed: {type(error).__name__}: {error}")

    def _answer_control(self, message: ControlResponse) -> None:
        future = self._controls.pop(message.call_id, None)
        if future is None:
            self._fail(f"the engine core answered control call {message.call_id}, which "
                       "was never made")
            return
        self._held = message.holding
        if future.done():  # the caller was cancelled; the call took effect all the same
            logger.info("control call %d answered after its caller left", message.call_id)
            return
        if message.error is not None:
            future.set_exception(ControlError(message.error, message.exc_type))
        else:
            future.set_result(message.result)

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        now = time.time()
        self.metrics.record_scheduler_stats(message.stats)
        self.metrics.record_core_outputs(message.outputs, now)
        processed = self.output_processor.process_outputs(message.outputs)
        if processed.stopped_by_string:
            self._send(FinishRequests(processed.stopped_by_string))
            for engine_request_id, _ in processed.stopped_by_string:
                self.metrics.record_sequence_finished(engine_request_id, "stop", now)
        for output in processed.request_outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue
            tracked.queue.put_nowait(output)
            if output.finished:
                self._untrack(output.request_id)

    async def _watch_core(self) -> None:
        bound = core_step_bound_s(self.config)
        while self.dead_error is None:
            await asyncio.sleep(min(1.0, bound / 4))
            if not self._requests or self._controls or self._held:
                continue
            silent = time.monotonic() - max(self._last_core_message, self._busy_since)
            if silent > bound:
                await self._core_hung(
                    f"the engine core is hung: {len(self._requests)} request(s) in flight and "
                    f"no step finished for {silent:.1f}s (bound {bound:.1f}s: "
                    f"--watchdog-timeout {self.config.parallel.watchdog_timeout_s:g}s + 20 ms "
                    f"a token of --max-num-batched-tokens "
                    f"{self.config.scheduler.max_num_batched_tokens}"
                    + (" + 80 ms an image token the step may make"
                       if self.config.model.takes_images else "")
                    + " + 5s); its stacks are in the log above")
                return

    async def _core_hung(self, message: str) -> None:
        logger.error("%s; dumping the engine core's stacks (%s)", message, self._core.describe())
        self._core.unwatch_exit()
        await self._core.kill()
        self._fail(message)

    def _on_core_exit(self) -> None:
        self._core.unwatch_exit()
        if not self._shutting_down and self.dead_error is None:
            asyncio.create_task(self._core_died())

    async def _core_died(self) -> None:
        """Deliver what the core sent before it died, then fail everything in flight."""
        if self._output_task is not None:
            self._output_task.cancel()
        message = None
        for received in await self._core.receive_remaining():
            if isinstance(received, EngineCoreFailed):
                message = received.message
            elif isinstance(received, EngineCoreOutputs):
                self._process_outputs(received)
        self._fail(message or self._core.exit_description())

    def _fail(self, message: str) -> None:
        if self.dead_error is not None:
            return
        parallel = self.config.parallel
        if parallel.data_parallel_size > 1:
            message = f"data-parallel replica {parallel.data_parallel_rank}: {message}"
        logger.error("engine is dead: %s", message)
        self.dead_error = EngineDeadError(message)
        self.output_processor.fail_all(message)
        for tracked in self._requests.values():
            tracked.queue.put_nowait(self.dead_error)
        failed, self._requests = list(self._requests), {}
        for request_id in failed:
            for callback in self.on_request_done:
                callback(request_id)
        for future in self._controls.values():
            if not future.done():
                future.set_exception(self.dead_error)
        self._num_sequences = 0
        self._idle.set()
        for callback in self.on_dead:
            callback()

    def _send(self, message: EngineCoreInput) -> None:
        self._core.send(message)
