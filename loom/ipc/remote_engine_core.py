"""Data-parallel replicas on other hosts: the head's end of their engine cores.

    head host: loom serve -dp 2 -dpl 1 -dpa HEAD_IP -dpp P       other host: loom serve --headless
      API server ─ DPAsyncLLM                                       -dp 2 -dpl 1 -dpr 1 -dpa HEAD_IP -dpp P
        ├─ replica 0: EngineCoreClient ─ local engine core
        ├─ replica 1: RemoteEngineCoreClient  tcp://HEAD_IP:a ◀──── engine core 1 (PUSH/PULL, as
        │                                     tcp://HEAD_IP:b ◀────   a local core's ipc://)
        └─ HeadRendezvous  ROUTER tcp://HEAD_IP:P ◀── DPHello ──── launcher (entrypoints/headless.py)
                                                  ── DPWelcome / DPRefusal / DPBye ─▶

Handshake. The headless launcher connects to the head's rpc port and announces its
ranks and its settings (``handshake_settings``, loom/handshake.py: the flags that must
agree, by name). The head refuses ranks it runs itself, ranks another host already
runs, and any setting that differs, naming each (``DPRefusal``; the launcher exits 2);
else it answers with the two addresses of each rank's sockets, bound by the head on
``--data-parallel-address`` at ports of its choosing (``DPWelcome``). The launcher then
starts those engine cores, which connect as a local core does.

Liveness, without a process sentinel: the connection is the sentinel. The head
watches its socket for a rank's output (a ZMQ monitor): once the core has connected,
its connection dropping (the process, its launcher or its host died) is the core's
death, handled as a local core's exit. ZMTP heartbeats on every TCP socket (both
ways, ``set_heartbeat``) turn a host that vanishes without closing its connections
into a dropped connection within ``--worker-health-timeout``. The launcher watches its
own connection to the head the same way and stops its replicas when the head goes
away (exit 1) or says goodbye (``DPBye`` after a clean shutdown; exit 0). A hung
remote core is judged by the same watchdog as a local one (``AsyncLLM``); ``kill``
then only drops the connection, and the head's exit ends the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from loom.config import EngineConfig
from loom.core.wire import (DPBye, DPHandshake, DPHello, DPRefusal, DPWelcome,
                            EngineCoreShutdown)
from loom.handshake import handshake_settings
from loom.ipc.engine_core_client import EngineCoreChannel

logger = logging.getLogger(__name__)

_HEARTBEAT_INTERVAL_MS = 1000


def set_heartbeat(socket: zmq.Socket, timeout_s: float) -> None:
    """ZMTP heartbeats: a peer silent for ``timeout_s`` (host gone, cable cut) has its
    connection dropped, which the monitors see."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
    socket.setsockopt(zmq.HEARTBEAT_TTL, int(timeout_s * 1000))


def rank_list(ranks: range | list[int]) -> str:
    ranks = list(ranks)
    return (f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}..{ranks[-1]}") if ranks else "none"


class HeadRendezvous:
    """The head's rpc port: welcomes the headless hosts that run its remote ranks."""

    def __init__(self, config: EngineConfig, remote: dict[int, tuple[str, str]]) -> None:
        self.config = config
        self.remote = remote  # rank -> (input address, output address) its core connects to
        self.settings = handshake_settings(config)
        self.address = (f"tcp://{config.parallel.data_parallel_address}:"
                        f"{config.parallel.data_parallel_rpc_port}")
        self.claimed: dict[int, str] = {}  # rank -> host
        self._welcomed: list[bytes] = []  # the launchers' identities, for DPBye
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(DPHandshake)
        self._context: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Bind the rpc port (a RuntimeError naming it if taken) and answer hellos."""
        self._context = zmq.asyncio.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        set_heartbeat(self.socket, self.config.parallel.worker_health_timeout_s)
        try:
            self.socket.bind(self.address)
        except zmq.ZMQError as error:
            self.close_now()
            raise RuntimeError(f"cannot listen for headless hosts on {self.address} "
                               f"(--data-parallel-address/--data-parallel-rpc-port): "
                               f"{error}") from None
        logger.info("waiting for data-parallel replica(s) %s on %s: start them with loom "
                    "serve --headless --data-parallel-address %s --data-parallel-rpc-port %d",
                    rank_list(sorted(self.remote)), self.address,
                    self.config.parallel.data_parallel_address,
                    self.config.parallel.data_parallel_rpc_port)
        self._task = asyncio.create_task(self._serve(), name="loom-dp-rendezvous")

    async def _serve(self) -> None:
        while True:
            identity, payload = await self.socket.recv_multipart()
            try:
                hello = self._decoder.decode(payload)
            except msgspec.DecodeError:
                hello = None
            if not isinstance(hello, DPHello):
                reply = DPRefusal("not a loom serve --headless hello")
            else:
                reply = self.answer(hello)
            if isinstance(reply, DPRefusal):
                logger.warning("refused a headless host: %s", reply.message)
            else:
                self._welcomed.append(identity)
            await self.socket.send_multipart([identity, self._encoder.encode(reply)])

    def answer(self, hello: DPHello) -> DPWelcome | DPRefusal:
        ranks = list(range(hello.start_rank, hello.start_rank + hello.num_ranks))
        where = f"host {hello.host} (data-parallel ranks {rank_list(ranks)})"
        if not ranks:
            return DPRefusal(f"{where} runs no replica: give --data-parallel-size-local >= 1")
        differences = [f"{name} is {hello.settings.get(name)!r} there, {value!r} on the head"
                       for name, value in self.settings.items()
                       if hello.settings.get(name) != value]
        if differences:
            return DPRefusal(f"{where} is configured differently from the head: "
                             + "; ".join(differences) + "; start it with the head's flags")
        foreign = [rank for rank in ranks if rank not in self.remote]
        if foreign:
            local = self.config.parallel.local_replica_ranks
            return DPRefusal(
                f"{where}: rank(s) {', '.join(map(str, foreign))} are not waited for; the head "
                f"runs rank(s) {rank_list(local)} itself and waits for "
                f"{rank_list(sorted(self.remote))} (--data-parallel-start-rank, "
                "--data-parallel-size-local)")
        taken = [rank for rank in ranks if rank in self.claimed]
        if taken:
            return DPRefusal(f"{where}: rank(s) {', '.join(map(str, taken))} already run on "
                             f"host {self.claimed[taken[0]]}")
        for rank in ranks:
            self.claimed[rank] = hello.host
        logger.info("data-parallel replica(s) %s joined from host %s", rank_list(ranks),
                    hello.host)
        parallel = self.config.parallel
        lockstep = parallel.data_parallel_lockstep_addresses
        return DPWelcome([(rank, *self.remote[rank]) for rank in ranks],
                         master_port=parallel.data_parallel_master_port,
                         lockstep_addresses=None if lockstep is None else list(lockstep))

    async def close(self) -> None:
        """Say goodbye to every welcomed host (its replicas were told to stop) and close."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._context is None:
            return
        for identity in self._welcomed:
            with contextlib.suppress(zmq.ZMQError):
                await self.socket.send_multipart([identity, self._encoder.encode(DPBye())])
        self.socket.close(linger=1000)
        self._context.term()
        self._context = None

    def close_now(self) -> None:
        if self._context is not None:
            self.socket.close(linger=0)
            self._context.term()
            self._context = None


class RemoteEngineCoreClient(EngineCoreChannel):
    """``EngineCoreClient``'s methods for a replica whose engine core runs on another host.

    ``bind`` (before the rendezvous welcomes anyone) binds the two sockets on the
    head's address at free ports; ``start`` waits for the core's ``EngineCoreReady``.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.rank = config.parallel.data_parallel_rank
        self.input_address = ""
        self.output_address = ""
        self.connected = False
        self.disconnected = asyncio.Event()
        self._on_exit = None
        self._monitor_task: asyncio.Task | None = None

    def bind(self) -> tuple[str, str]:
        """Bind both sockets; returns (input address, output address)."""
        timeout_s = self.config.parallel.worker_health_timeout_s
        address = f"tcp://{self.config.parallel.data_parallel_address}:*"
        self._sync_context = zmq.Context()
        self._input_socket = self._sync_context.socket(zmq.PUSH)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)
        set_heartbeat(self._input_socket, timeout_s)
        try:
            self._input_socket.bind(address)
        except zmq.ZMQError as error:
            self._close()
            raise RuntimeError(f"cannot bind data-parallel replica {self.rank}'s sockets on "
                               f"{address}: {error}; --data-parallel-address must be an IP "
                               "address of this (the head) host") from None
        self.input_address = self._input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._async_context = zmq.asyncio.Context()
        self._output_socket = self._async_context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        set_heartbeat(self._output_socket, timeout_s)
        monitor = self._output_socket.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._output_socket.bind(address)
        self.output_address = self._output_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor_task = asyncio.create_task(self._monitor(monitor),
                                                 name=f"loom-replica-{self.rank}-monitor")
        return self.input_address, self.output_address

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_ACCEPTED:
                    self.connected = True
                elif event == zmq.EVENT_DISCONNECTED and self.connected:
                    self.disconnected.set()
                    if self._on_exit is not None:
                        self._on_exit()
                    return
        finally:
            monitor.close(linger=0)

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> int:
        """Wait until the remote core can serve; returns its KV blocks. RuntimeError if
        it fails, disconnects while loading, or no host runs it in time."""
        bound_s = self.config.parallel.worker_start_timeout_s
        deadline = time.monotonic() + bound_s
        while True:
            blocks = await self._poll_ready()
            if blocks is not None:
                return blocks
            if self.disconnected.is_set():
                raise RuntimeError(f"the engine core of data-parallel replica {self.rank} (on "
                                   "a headless host) disconnected while loading the model")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine core for data-parallel replica {self.rank} "
                                   f"was ready within {bound_s:.0f} s: start its host's loom "
                                   "serve --headless (see the log for the flags)")

    async def shutdown(self, timeout: float) -> None:
        """Ask the core to stop and wait (up to ``timeout``) for its connection to close."""
        if self._sync_context is None:
            return
        if not self.disconnected.is_set():
            self.send(EngineCoreShutdown())  # queued for a core that has not connected yet
            if self.connected:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.disconnected.wait(), timeout)
        self._close()

    async def kill(self) -> None:
        """A hung remote core: drop its connection (its host's launcher stops it when the
        head exits, which a hang leads to)."""
        self._close()

    def _close(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            self._monitor_task = None
        self._close_sockets(input_linger_ms=1000)  # the shutdown message still goes out

    # ----------------------------------------------------------------- liveness

    def watch_exit(self, callback) -> None:
        """Call ``callback`` once the core's connection has dropped."""
        self._on_exit = callback
        if self.disconnected.is_set():
            asyncio.get_running_loop().call_soon(callback)

    def unwatch_exit(self) -> None:
        self._on_exit = None

    def exit_description(self) -> str:
        return (f"the engine core on a headless host ({self.output_address}) disconnected: "
                "its process, its loom serve --headless or its host is gone")

    def describe(self) -> str:
        return f"on a headless host, {self.output_address}"

    def is_alive(self) -> bool:
        return self.connected and not self.disconnected.is_set()
