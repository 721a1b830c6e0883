"""The tensor-parallel group, passed explicitly to every layer that shards, and the
expert-parallel group of MoE layers over the same ranks.

Layers never call ``torch.distributed.get_rank()``; they receive a ``TPGroup``.
With ``world_size == 1`` every collective is the identity and no process group
exists, so single-rank code paths need no ``torch.distributed`` at all.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class CollectiveBytes:
    """Bytes this rank has handed to collectives since start (benchmarks/dp_ep.py reads
    them through ``Worker.collective_bytes``): the tensors it all-reduced, and the rows
    it sent by all-to-all, all of them and those to other ranks."""

    all_reduce: int = 0
    all_to_all: int = 0
    all_to_all_remote: int = 0


# This process's count (a rank is one process).
collective_bytes = CollectiveBytes()


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    # The same ranks over gloo, for host-side agreement (``any_rank``) where ``group`` is
    # NCCL; None where ``group`` is gloo itself.
    host_group: dist.ProcessGroup | None = field(default=None, kw_only=True)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
            collective_bytes.all_reduce += tensor.nbytes
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along ``dim`` in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank: one all-reduce on the host (gloo), never on
        a device stream (one that may be capturing, or just failed to)."""
        if self.world_size == 1:
            return flag
        group = self.host_group or self.group
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        tensor = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return bool(tensor.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def shard_range(self, size: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of ``size`` (which must divide)."""
        if size % self.world_size:
            raise ValueError(f"size {size} is not divisible by tensor parallel size "
                             f"{self.world_size}")
        shard = size // self.world_size
        return self.rank * shard, (self.rank + 1) * shard


SINGLE = TPGroup()


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel group of MoE layers: ``size`` ranks, rank r owning experts
    ``[r * E / size, (r + 1) * E / size)`` whole (the seed's num_experts_start_offset and
    num_experts_per_rank).

    Two layouts (layers/fused_moe.py):

    - over the tensor-parallel ranks (``across`` None; vLLM's --enable-expert-parallel
      with one replica): hidden states are replicated over ``tp_group``, each rank runs
      the tokens routed to its experts, and the all-reduce that ends the layer combines
      them;
    - over every rank of every data-parallel replica (``across``: the group of all
      of them, rank ``dp_rank * TP + tp_rank``; FastDeploy's and vLLM's DP + EP): each
      replica holds its own tokens, so the layer sends each (token, expert) pair's row
      to the rank owning the expert and the results back (``dispatch`` / ``combine``:
      all-to-all over ``across``), and nothing is all-reduced."""

    tp_group: TPGroup = SINGLE
    across: TPGroup | None = None
    # EPLB (layers/fused_moe.py): slots for copies of busy experts beside the model's
    # experts; the ranks split num_experts + num_redundant_experts slots.
    num_redundant_experts: int = 0

    @property
    def group(self) -> TPGroup:
        """The ranks that split the experts, as a group to gather and reduce over."""
        return self.across or self.tp_group

    @property
    def size(self) -> int:
        return (self.across or self.tp_group).world_size

    @property
    def rank(self) -> int:
        return (self.across or self.tp_group).rank

    @property
    def all_to_all(self) -> bool:
        """Tokens travel to their experts' ranks (the layout across replicas)."""
        return self.across is not None

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the expert slots this rank owns (with EPLB's redundant slots,
        of num_experts + num_redundant_experts)."""
        num_experts += self.num_redundant_experts
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split over expert parallel size "
                             f"{self.size}; choose a size that divides them")
        per_rank = num_experts // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def exchange(self, rows: torch.Tensor, send_counts: list[int],
                 recv_counts: list[int]) -> torch.Tensor:
        """All-to-all over ``across``: rows ``[sum(send_counts[:r]), ..)`` of ``rows``
        (N, ...) go to rank r; returns what every rank sent here, in rank order
        (``sum(recv_counts)`` rows)."""
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts,
                               group=self.across.group)
        if rows.is_floating_point():  # hidden rows (not the expert ids beside them)
            row_bytes = rows[0].nbytes if rows.shape[0] else 0
            collective_bytes.all_to_all += rows.nbytes
            collective_bytes.all_to_all_remote += (rows.nbytes
                                                   - send_counts[self.rank] * row_bytes)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """(size,) int64 rows this rank sends each rank -> (size,) rows each sends here."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.across.group)
        return recv


NO_EP = EPGroup()


def expert_parallel_group(tp_group: TPGroup, expert_parallel_size: int,
                          across: TPGroup | None = None,
                          num_redundant_experts: int = 0) -> EPGroup:
    """The EP group over ``tp_group``'s ranks, or over ``across`` (every replica's ranks,
    when the size spans replicas), or NO_EP (experts split like every other matrix,
    over TP) for size 1; with ``num_redundant_experts`` EPLB's extra slots."""
    if expert_parallel_size == 1:
        return NO_EP
    if across is not None and expert_parallel_size == across.world_size \
            and across.world_size > tp_group.world_size:
        return EPGroup(tp_group, across, num_redundant_experts)
    if expert_parallel_size != tp_group.world_size:
        raise ValueError(f"expert parallel size {expert_parallel_size} must be 1, the "
                         f"tensor parallel size {tp_group.world_size}, or that times the "
                         "data parallel size")
    return EPGroup(tp_group, None, num_redundant_experts)


# The store the ranks met through: a TCP server inside rank 0's process, which
# destroy_distributed also uses to leave in order.
_store: dist.Store | None = None


def host_store(master_addr: str, world_size: int, timeout_s: float = 600.0) -> int:
    """Start rank 0's store now, in this process, on a port the OS picks, and return the
    port; ``init_distributed`` in this process then joins through it. A port found free
    and bound only later, by rank 0's start-up, can be taken in between (a Ray node's
    processes open ports all the while: EADDRINUSE at start-up)."""
    global _store
    _store = dist.TCPStore(master_addr, 0, world_size, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    return _store.port


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     device: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the ranks' process group (TCP store at master_addr:master_port, hosted by
    rank 0, or already hosted here by ``host_store``; gloo on CPU, NCCL on CUDA) and
    return this rank's TP group over all of them."""
    global _store
    if world_size == 1:
        return SINGLE
    timeout = datetime.timedelta(seconds=timeout_s)
    if not (rank == 0 and _store is not None and _store.port == master_port):
        _store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                               timeout=timeout)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=_store, rank=rank, world_size=world_size,
                            timeout=timeout)
    host_group = _host_group(backend, None, timeout)
    if host_group is not None:
        _subgroups.append(host_group)
    return TPGroup(rank, world_size, dist.group.WORLD, host_group=host_group)


def _host_group(backend: str, ranks: list[int] | None,
                timeout: datetime.timedelta) -> dist.ProcessGroup | None:
    """A gloo group over ``ranks`` (None: all) beside an NCCL one, or None under gloo.
    Collective: every rank makes it, in the same order."""
    if backend != "nccl":
        return None
    return dist.new_group(ranks, timeout=timeout, backend="gloo")


# Every rank of every data-parallel replica, when MoE experts span the replicas
# (init_across_replicas); None otherwise. The subgroups made besides the world, whose
# collective timeouts set_collective_timeout sets too.
_across: TPGroup | None = None
_subgroups: list[dist.ProcessGroup] = []


def init_across_replicas(tp_rank: int, tp_size: int, replica: int, num_replicas: int,
                         master_addr: str, master_port: int, device: str,
                         timeout_s: float = 600.0) -> TPGroup:
    """Join the one process group of every rank of every replica (rank ``replica * tp_size
    + tp_rank``; the store at master_addr:master_port, hosted by replica 0's rank 0) and
    return this rank's TP group: a subgroup over its replica's ranks. Every rank makes
    every replica's subgroup, in replica order (``dist.new_group`` is collective). The
    whole group is ``across_replicas()``, the EP group's ``across``."""
    global _store, _across
    world_size = tp_size * num_replicas
    rank = replica * tp_size + tp_rank
    timeout = datetime.timedelta(seconds=timeout_s)
    _store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                           timeout=timeout)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=_store, rank=rank, world_size=world_size,
                            timeout=timeout)
    _across = TPGroup(rank, world_size, dist.group.WORLD)
    tp_group = SINGLE
    for r in range(num_replicas):
        ranks = list(range(r * tp_size, (r + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        host_group = _host_group(backend, ranks, timeout) if tp_size > 1 else None
        if r == replica:
            _subgroups.extend(g for g in (group, host_group) if g is not None)
            if tp_size > 1:
                tp_group = TPGroup(tp_rank, tp_size, group, host_group=host_group)
    return tp_group


def across_replicas() -> TPGroup | None:
    """The group of every replica's ranks (init_across_replicas), or None."""
    return _across


def rank0_value(key: str, value: str) -> str:
    """Rank 0's ``value`` for ``key``, through the store the ranks met at (rank 0 writes
    it, the others wait for it); ``value`` itself with one rank."""
    if _store is None:
        return value
    if dist.get_rank() == 0:
        _store.set(key, value)
        return value
    return _store.get(key).decode()


def set_collective_timeout(timeout_s: float) -> None:
    """From now on a collective that waits longer than ``timeout_s`` fails. Start-up
    joins with the long start-up timeout (a peer may still be loading its shard); once
    serving, no collective may outlast the step it belongs to."""
    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    for group in _subgroups:
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def destroy_distributed(timeout_s: float = 3.0) -> None:
    """Leave the process group in order, rank 0 last; never raises.

    Rank 0's process hosts the store, so a rank still tearing down when rank 0
    exits can lose it mid-call (seen as SIGABRT in rank 1). So: every rank says it
    has arrived and waits for all others (no collective is then in flight); ranks
    1..N-1 destroy their group and say they have left; rank 0 waits for that, then
    destroys its own. Each wait gives up after ``timeout_s`` (a rank that died never
    arrives) and teardown goes on. ``timeout_s=0`` skips the waits (after a failure,
    when peers may be stuck in a collective).
    """
    global _store, _across
    if not dist.is_initialized():
        return
    store, _store, _across = _store, None, None
    _subgroups.clear()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if store is None or timeout_s <= 0:
        _quietly(dist.destroy_process_group)
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    _quietly(store.set, f"loom/shutdown/arrived/{rank}", "1")
    _quietly(store.wait, [f"loom/shutdown/arrived/{r}" for r in range(world_size)], timeout)
    if rank != 0:
        _quietly(dist.destroy_process_group)
        _quietly(store.set, f"loom/shutdown/left/{rank}", "1")
        return
    _quietly(store.wait, [f"loom/shutdown/left/{r}" for r in range(1, world_size)], timeout)
    _quietly(dist.destroy_process_group)


def _quietly(call, *args) -> None:
    """Teardown goes on whatever one step raised (a peer gone, a wait timed out)."""
    try:
        call(*args)
    except Exception as exc:
        logger.warning("distributed teardown: %s failed: %s: %s",
                       getattr(call, "__name__", call), type(exc).__name__, exc)
