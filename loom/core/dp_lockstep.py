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
        self.bound_s = bound_s
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        address = inbox_address(owner, port, self.rank)
        self._inbox_path = address.removeprefix("ipc://")
        self.inbox.bind(address)
        self.peers = []
        for rank in range(self.size):
            if rank != self.rank:
                peer = self.context.socket(zmq.PUSH)
                peer.setsockopt(zmq.LINGER, 0)
                peer.connect(inbox_address(owner, port, rank))
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
        try:
            os.unlink(self._inbox_path)
        except OSError:
            pass
