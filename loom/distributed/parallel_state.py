"""The tensor-parallel group, passed explicitly to every layer that shards.

Layers never call ``torch.distributed.get_rank()``; they receive a ``TPGroup``.
With ``world_size == 1`` every collective is the identity and no process group
exists, so single-rank code paths need no ``torch.distributed`` at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
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


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     device: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the ranks' process group (TCP store at master_addr:master_port, gloo on
    CPU, NCCL on CUDA) and return this rank's TP group over all of them."""
    import datetime

    if world_size == 1:
        return SINGLE
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, dist.group.WORLD)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
