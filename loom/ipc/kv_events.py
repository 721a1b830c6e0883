"""The KV connector's report channel: every rank's transfer threads → its engine core.

    engine core PULL (tcp://host:<any port>)  ◀── KVTransferEvent ── PUSH of each rank

Apart from the task queue, because the reports come from background threads at any
time, also between steps and while the engine core is idle (a prefill instance whose
decode peer just pulled its blocks). msgspec, never pickle.
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from loom.core.wire import KVTransferEvent


class KVEventReceiver:
    """The engine core's end: bound to any free port on ``host``."""

    def __init__(self, host: str) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://{host}:*")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(KVTransferEvent)

    def poll(self, timeout_ms: int = 0) -> list[KVTransferEvent]:
        """Every report that is there, waiting up to ``timeout_ms`` for the first."""
        events = []
        while self.socket.poll(timeout_ms, zmq.POLLIN):
            events.append(self._decoder.decode(self.socket.recv(copy=False).buffer))
            timeout_ms = 0
        return events

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()


class KVEventSender:
    """A rank's end; any of its threads may send."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._closed = False

    def send(self, event: KVTransferEvent) -> None:
        """Report ``event``; after ``close`` (the rank is shutting down, its engine core
        with it) there is no one to tell, and nothing is sent."""
        with self._lock:
            if not self._closed:
                self._socket.send(self._encoder.encode(event))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._socket.close()
        self._context.term()
