"""EngineCoreClient: the API process's end of the engine core process.

    API process ── PUSH ─▶ EngineCoreInput   (add / abort / finish / shutdown) ─▶ PULL ┐
                ◀─ PULL ── EngineCoreMessage (ready / outputs+stats / failed)  ◀─ PUSH ┘
                                                   engine core (loom.core.engine_core_proc)

One object starts, watches and stops the engine core process and owns both sockets.
It binds them before the process starts, at ipc paths in a fresh temporary directory
named after this process (two servers never collide; a killed one's is debris,
``loom.ipc.debris``); the core connects. Messages are ``loom.core.wire`` types,
encoded as msgpack. A send never blocks (no high-water mark); receives are awaited in
the caller's asyncio loop.

It judges nothing: ``AsyncLLM`` decides from what arrives (or does not) whether the
core is dead or hung, and calls ``kill``. ``watch_exit`` tells it when the core is gone
(here: the process's sentinel). A replica whose core runs on another host
(``loom serve --headless``) has a ``RemoteEngineCoreClient`` instead
(``loom/ipc/remote_engine_core.py``), with the same methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile

import msgspec
import zmq
import zmq.asyncio

from loom.config import EngineConfig
from loom.core.engine_core_proc import run_engine_core
from loom.core.wire import (EngineCoreFailed, EngineCoreInput, EngineCoreMessage, EngineCoreReady,
                            EngineCoreRequest, EngineCoreShutdown)
from loom.ipc.debris import remove_debris
from loom.ipc.shm_ring import SenderRing
from loom.ipc.signal import segment_name
from loom.ipc.task_queue import new_instance_id

logger = logging.getLogger(__name__)

STACK_DUMP_WAIT_S = 0.5  # for a hung core's faulthandler to write its stacks


class EngineCoreChannel:
    """The two ZeroMQ sockets to one engine core and the messages on them: inputs PUSHed
    from a sync context, outputs PULLed from an asyncio one. ``EngineCoreClient`` (a core
    process of this host, ipc://) and ``RemoteEngineCoreClient`` (a headless host's core,
    tcp://, ipc/remote_engine_core.py) bind them their own way."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
        self._sync_context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None

    def _close_sockets(self, input_linger_ms: int = 0) -> None:
        """Close both (those bound so far); ``input_linger_ms``: how long a last input
        may still go out."""
        if self._sync_context is not None:
            self._input_socket.close(linger=input_linger_ms)
            self._sync_context.term()
            self._sync_context = None
        if self._async_context is not None:
            self._output_socket.close(linger=0)
            self._async_context.term()
            self._async_context = None

    def send(self, message: EngineCoreInput) -> None:
        self._input_socket.send(self._encoder.encode(message), copy=False)

    async def receive(self) -> EngineCoreMessage:
        """The core's next message; waits as long as it takes."""
        return self._decoder.decode(await self._output_socket.recv())

    async def receive_remaining(self, timeout_ms: int = 100) -> list[EngineCoreMessage]:
        """Every message still on its way (e.g. from a core that died), in order: each
        awaited at most ``timeout_ms`` after the one before."""
        messages = []
        while await self._output_socket.poll(timeout_ms):
            messages.append(await self.receive())
        return messages

    async def _poll_ready(self, timeout_ms: int = 200) -> int | None:
        """A loading core's KV blocks once it says ``EngineCoreReady``; None if nothing
        came within ``timeout_ms``. RuntimeError if it failed or sent anything else."""
        if not await self._output_socket.poll(timeout_ms):
            return None
        message = await self.receive()
        if isinstance(message, EngineCoreReady):
            return message.num_blocks
        if isinstance(message, EngineCoreFailed):
            raise RuntimeError(message.message)
        raise RuntimeError(f"the engine core sent {type(message).__name__} before it was ready")


class EngineCoreClient(EngineCoreChannel):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._socket_dir = tempfile.mkdtemp(prefix=f"loom-{os.getpid()}-engine-")  # ipc.debris
        self.input_address = f"ipc://{self._socket_dir}/input"
        self.output_address = f"ipc://{self._socket_dir}/output"
        self.process: multiprocessing.process.BaseProcess | None = None
        # Images' large arrays go to the core, on this host, through shared memory
        # (loom/ipc/shm_ring.py); a remote core's client has none and sends them inline.
        self._mm_ring = SenderRing(segment_name(os.getpid(), new_instance_id(), "mm-input"),
                                   config.model.mm_shm_cache_size_mib, num_readers=1)

    def send(self, message: EngineCoreInput) -> None:
        if isinstance(message, EngineCoreRequest) and message.mm_features:
            message = msgspec.structs.replace(
                message, mm_features=self._mm_ring.stage(message.mm_features))
        super().send(message)

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> int:
        """Bind, start the engine core process and wait until it can serve; returns its
        KV blocks. Raises RuntimeError if it fails or exits while loading."""
        self._sync_context = zmq.Context()
        self._input_socket = self._sync_context.socket(zmq.PUSH)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input_socket.bind(self.input_address)
        self._async_context = zmq.asyncio.Context()
        self._output_socket = self._async_context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.bind(self.output_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="loom-engine-core", daemon=False,
            args=(msgspec.msgpack.encode(self.config), self.input_address, self.output_address))
        self.process.start()
        while True:
            blocks = await self._poll_ready()
            if blocks is not None:
                return blocks
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.process.exitcode} while loading the model")

    async def shutdown(self, timeout: float) -> None:
        """Ask the core to stop (it finishes its current step), wait up to ``timeout``
        for it to exit, kill it past that, and close the sockets. Idempotent."""
        if self.is_alive():
            self.send(EngineCoreShutdown())
        await asyncio.get_running_loop().run_in_executor(None, self._join, timeout)
        self._close_sockets()

    async def kill(self) -> None:
        """For a core that makes no progress: its stacks to the log (SIGUSR1,
        faulthandler), then SIGKILL. Its workers die with it (PR_SET_PDEATHSIG); what
        they owned is debris, removed here."""
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(self.pid, signal.SIGUSR1)
        await asyncio.sleep(STACK_DUMP_WAIT_S)
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._mm_ring.close()
        await asyncio.get_running_loop().run_in_executor(None, remove_debris)

    def _join(self, timeout: float) -> None:
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("engine core did not exit in %.0f s; killing it", timeout)
                self.process.kill()
                self.process.join(5)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._mm_ring.close()  # the core read everything it will ever read

    # ----------------------------------------------------------------- the process

    def watch_exit(self, callback) -> None:
        """Call ``callback`` (in this event loop) once the core process has exited."""
        asyncio.get_running_loop().add_reader(self.process.sentinel, callback)

    def unwatch_exit(self) -> None:
        if self.process is not None:
            asyncio.get_running_loop().remove_reader(self.process.sentinel)

    def exit_description(self) -> str:
        return f"the engine core process died (exit code {self.exitcode})"

    def describe(self) -> str:
        return f"pid {self.pid}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()
