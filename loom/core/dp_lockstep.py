"""Lock-step of data-parallel replicas whose MoE experts span all of them.

With experts across replicas (``ParallelConfig.experts_across_replicas``) every rank
of every replica must enter every MoE layer's all-to-all, so the replicas' engine cores
step together: each step, each core tells every peer whether it has work, and if any
has, all of them step, the idle ones with a dummy forward (``EngineCore.step(lockstep=
True)``); if none has, all go idle. vLLM's DP + EP does the same with its coordinator;
here the cores tell each other directly, with no torch (the engine cores hold none).

    engine core r ── PUSH ─▶ (round, r, has_work) ─▶ PULL of every peer, bound at
                                         ipc://TMP/loom-<API pid>-dp-PORT-rank
    round n: send mine, collect the D-1 others' round n, step if any has work

With replicas on several hosts (``--data-parallel-size-local``) the inboxes are TCP and
relayed by the head (``LockstepRelay``, in the API process, bound on
``--data-parallel-address``): per replica rank a PULL its peers' PUSH sockets connect
to, forwarded by ``zmq.proxy`` (C, without the GIL) to a PUSH its core's inbox connects
to; the head passes the addresses down (``ParallelConfig.data_parallel_lockstep_addresses``,
to headless hosts in ``DPWelcome``), so every port lies on the head, as the replicas'
own sockets do.

    engine core r ── PUSH ─▶ tcp://HEAD:a_p ─ relay p (head) ─▶ tcp://HEAD:b_p ─▶ PULL of peer p

Rounds are numbered from 1 on every core and each core takes part in every round, so
a round's decision is the same everywhere. A peer can be one round ahead (it decided
round n, which needed ours, and sent n + 1): its message waits in ``_early``. An idle
core waits on its input socket and on its inbox (``inbox`` in the core's poller): a new
request at any replica starts a round that wakes all of them.

Nothing waits forever: a peer whose flag does not come within ``bound_s`` (the longest a
step may run, plus margin) is taken for dead or hung (``EngineDeadError``); meanwhile
``on_wait`` runs every second (the core checks its workers and its parent then).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from loom.config import EngineConfig
from loom.errors import EngineDeadError

_POLL_MS = 1000


class StepFlag(msgspec.Struct, array_like=True, tag="dp_step_flag"):
    """One core's word for one round."""

    round: int
    rank: int
    has_work: bool


def inbox_address(owner_pid: int, master_port: int, rank: int) -> str:
    """Where replica ``rank``'s engine core listens for its peers' flags: named after the
    API process that started every replica's core (``loom.ipc.debris`` removes it if
    that process was killed) and the port its ranks' process group was given."""
    name = f"loom-{owner_pid}-dp-{master_port}-{rank}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


class DPLockstep:
    def __init__(self, config: EngineConfig, bound_s: float) -> None:
        parallel = config.parallel
        self.rank, self.size = parallel.data_parallel_rank, parallel.data_parallel_size
        port, owner = parallel.data_parallel_master_port, os.getppid()
        relayed = parallel.data_parallel_lockstep_addresses
        self.bound_s = bound_s
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self._inbox_path = None
        if relayed is not None:  # replicas on several hosts: through the head's relay
            self.inbox.connect(relayed[self.rank][1])
        else:
            address = inbox_address(owner, port, self.rank)
            self._inbox_path = address.removeprefix("ipc://")
            self.inbox.bind(address)
        self.peers = []
        for rank in range(self.size):
            if rank != self.rank:
                peer = self.context.socket(zmq.PUSH)
                peer.setsockopt(zmq.LINGER, 0)
                peer.connect(relayed[rank][0] if relayed is not None
                             else inbox_address(owner, port, rank))
                self.peers.append(peer)
        self.round = 0
        self._early: list[StepFlag] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepFlag)

    def agree(self, has_work: bool, on_wait: Callable[[], None]) -> bool:
        """This round's decision: whether every replica steps now (any has work)."""
        self.round += 1
        message = self._encoder.encode(StepFlag(self.round, self.rank, has_work))
        for peer in self.peers:
            peer.send(message)  # queued until the peer's inbox is there
        flags = [flag for flag in self._early if flag.round == self.round]
        self._early = [flag for flag in self._early if flag.round != self.round]
        deadline = time.monotonic() + self.bound_s
        while len(flags) < self.size - 1:
            if not self.inbox.poll(_POLL_MS):
                on_wait()
                if time.monotonic() > deadline:
                    heard = {flag.rank for flag in flags} | {self.rank}
                    silent = sorted(set(range(self.size)) - heard)
                    raise EngineDeadError(
                        f"data-parallel replicas {silent} sent no step flag for round "
                        f"{self.round} in {self.bound_s:.0f}s; their engine cores are dead "
                        "or hung, and the replicas' experts cannot step without them")
                continue
            flag = self._decoder.decode(self.inbox.recv())
            if flag.round == self.round:
                flags.append(flag)
            elif flag.round == self.round + 1:
                self._early.append(flag)
            else:
                raise EngineDeadError(f"replica {flag.rank} sent a step flag for round "
                                      f"{flag.round} while this one is in round {self.round}; "
                                      "the replicas are out of step")
        return has_work or any(flag.has_work for flag in flags)

    @property
    def has_news(self) -> bool:
        """A peer has started the next round (its flag is waiting here)."""
        return bool(self._early) or bool(self.inbox.poll(0))

    def close(self) -> None:
        self.context.destroy(linger=0)
        if self._inbox_path is not None:
            try:
                os.unlink(self._inbox_path)
            except OSError:
                pass


class LockstepRelay:
    """The head's relay of the lock-step flags for replicas on several hosts: for each
    replica rank a PULL (its peers send there) and a PUSH (its core's inbox receives
    from there), both bound on ``host`` at free ports, joined by ``zmq.proxy_steerable``
    in a thread of their own (the forwarding runs in libzmq, never holding the GIL)."""

    def __init__(self, host: str, num_replicas: int) -> None:
        self.context = zmq.Context()
        self.addresses: list[tuple[str, str]] = []
        self._threads: list[threading.Thread] = []
        self._controls: list[zmq.Socket] = []
        try:
            for rank in range(num_replicas):
                front, back = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
                for sock in (front, back):
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.bind(f"tcp://{host}:*")
                control_address = f"inproc://loom-lockstep-relay-{rank}"
                control = self.context.socket(zmq.PAIR)
                control.bind(control_address)
                self._controls.append(control)
                self.addresses.append((front.getsockopt_string(zmq.LAST_ENDPOINT),
                                       back.getsockopt_string(zmq.LAST_ENDPOINT)))
                thread = threading.Thread(target=self._relay, args=(front, back, control_address),
                                          name=f"loom-lockstep-relay-{rank}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except zmq.ZMQError as error:
            self.close()
            raise RuntimeError(f"cannot bind the data-parallel lock-step relay on {host} "
                               f"(--data-parallel-address must be an IP address of this, the "
                               f"head, host): {error}") from None

    def _relay(self, front: zmq.Socket, back: zmq.Socket, control_address: str) -> None:
        control = self.context.socket(zmq.PAIR)
        control.connect(control_address)
        try:
            zmq.proxy_steerable(front, back, None, control)
        except zmq.ZMQError:
            pass
        finally:
            for sock in (front, back, control):
                sock.close(linger=0)

    def close(self) -> None:
        for control in self._controls:
            control.setsockopt(zmq.SNDTIMEO, 1000)  # a relay thread that never started
            try:
                control.send(b"TERMINATE")
            except zmq.Again:
                pass
        for thread in self._threads:
            thread.join(5)
        for control in self._controls:
            control.close(linger=0)
        self._controls, self._threads = [], []
        self.context.destroy(linger=0)
