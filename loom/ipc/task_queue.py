"""TaskQueue: the engine broadcasts to every rank; ranks reply to the engine.

Two ZeroMQ sockets, both bound by the engine, every worker connects:

    engine XPUB  ──(ExecuteModel | WorkerShutdown)──▶  SUB of every rank
    engine PULL  ◀──(StepResult from rank 0, WorkerFailure / RemoteStatus from any)── PUSH

The messages are msgspec Structs in tagged unions (``loom.core.wire``), encoded once
as msgpack (never pickle). The engine counts subscriptions on its XPUB socket before
the first broadcast, so no message is lost to a late joiner. Addresses are per engine
instance: ipc:// files in a private temp dir on one host, tcp:// on master_addr
across hosts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from loom.core.wire import EngineToWorker, WorkerToEngine


class UnexpectedMessageError(RuntimeError):
    """A message arrived that its receiver is not waiting for (a result for another
    step, a second result): the two ends disagree about the protocol's state. Never
    dropped in silence, since a lost reply is an engine that waits forever."""


# ----------------------------------------------------------------- addresses


@dataclass(frozen=True)
class TaskQueueAddresses:
    broadcast: str
    results: str

    @classmethod
    def local(cls, instance_id: str) -> tuple[TaskQueueAddresses, str]:
        """ipc:// addresses in a fresh private dir; returns them and the dir to remove."""
        root = tempfile.mkdtemp(prefix=f"loom-{os.getpid()}-{instance_id}-")  # loom.ipc.debris
        return cls(f"ipc://{os.path.join(root, 'broadcast')}",
                   f"ipc://{os.path.join(root, 'results')}"), root

    @classmethod
    def tcp(cls, host: str, master_port: int) -> TaskQueueAddresses:
        """Across hosts: master_port is torch.distributed's store; the queue takes the
        next two ports."""
        return cls(f"tcp://{host}:{master_port + 1}", f"tcp://{host}:{master_port + 2}")

    @classmethod
    def tcp_any_port(cls, host: str) -> TaskQueueAddresses:
        """Across hosts, on two ports the system chooses (``TaskQueue.addresses`` then
        holds the bound ones): for ranks that learn the addresses from the engine itself,
        as Ray actors do."""
        return cls(f"tcp://{host}:*", f"tcp://{host}:*")


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]


# ----------------------------------------------------------------- the two ends


class TaskQueue:
    """The engine's end."""

    def __init__(self, addresses: TaskQueueAddresses, ipc_dir: str | None = None) -> None:
        self.addresses = addresses
        self._ipc_dir = ipc_dir
        self._context = zmq.Context()
        self._broadcast = self._context.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # one message per subscriber
        self._broadcast.setsockopt(zmq.SNDHWM, 0)
        self._broadcast.setsockopt(zmq.LINGER, 0)
        self._results = self._context.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        self._results.setsockopt(zmq.LINGER, 0)
        try:
            self._broadcast.bind(addresses.broadcast)
            self._results.bind(addresses.results)
        except zmq.ZMQError as exc:
            self.close()
            raise RuntimeError(f"cannot bind the task queue at {addresses}: {exc}; "
                               "choose another --master-port") from exc
        # What the ranks connect to: the addresses as bound (a port "*" is chosen now).
        self.addresses = TaskQueueAddresses(
            self._broadcast.getsockopt_string(zmq.LAST_ENDPOINT),
            self._results.getsockopt_string(zmq.LAST_ENDPOINT))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerToEngine)
        self.num_subscribers = 0
        self._closed = False

    def poll_subscriptions(self, timeout_ms: int = 0) -> int:
        """Count subscriptions that arrived within ``timeout_ms``; returns the total."""
        while self._broadcast.poll(timeout_ms, zmq.POLLIN):
            if self._broadcast.recv()[:1] == b"\x01":
                self.num_subscribers += 1
            timeout_ms = 0
        return self.num_subscribers

    def broadcast(self, message: EngineToWorker) -> None:
        self._broadcast.send(self._encoder.encode(message), copy=False)

    def poll(self, timeout_ms: int) -> WorkerToEngine | None:
        """The next message from any rank, or None after ``timeout_ms``."""
        if not self._results.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decoder.decode(self._results.recv(copy=False).buffer)

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._broadcast.close(linger=0)
        self._results.close(linger=0)
        self._context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class TaskQueueClient:
    """A worker's end."""

    def __init__(self, addresses: TaskQueueAddresses) -> None:
        self._context = zmq.Context()
        self._tasks = self._context.socket(zmq.SUB)
        self._tasks.setsockopt(zmq.RCVHWM, 0)
        self._tasks.setsockopt(zmq.SUBSCRIBE, b"")
        self._tasks.connect(addresses.broadcast)
        self._replies = self._context.socket(zmq.PUSH)
        self._replies.setsockopt(zmq.SNDHWM, 0)
        self._replies.setsockopt(zmq.LINGER, 2000)  # a failure report should get out
        self._replies.connect(addresses.results)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineToWorker)

    def poll(self, timeout_ms: int) -> EngineToWorker | None:
        """The next broadcast, or None after ``timeout_ms``."""
        if not self._tasks.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decoder.decode(self._tasks.recv(copy=False).buffer)

    def send(self, message: WorkerToEngine) -> None:
        self._replies.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._tasks.close(linger=0)
        self._replies.close()
        self._context.term()
