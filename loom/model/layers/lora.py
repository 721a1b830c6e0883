"""LoRA on a linear layer, batched (loom/lora.py): ``y += scale * B (A x)`` per row, by the
adapter of the request the row belongs to, never merged into the base weight.

A ``LoRASlots`` hangs on a ``LinearBase`` (``linear.lora``) and holds every adapter slot's
A and B for it: for a fused layer (q|k|v, gate|up) one A per projection stacked along
the rank, and B block-diagonal (projection p's rank columns write only its output rows),
so one shrink and one expand product serve all of a fused layer's projections. The
model runner says, for each step, which rows run which slot (``lora_step``): rows are
grouped by adapter (Punica's segments), and each group's ``x A^T`` (shrink) and
``(x A^T) B^T`` (expand, the scale folded into B) are added to its rows of the base
output. Rows of the base model and steps without adapters cost nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# The step's groups: (slot, the token rows that run it), set by the model runner
_groups: list[tuple[int, torch.Tensor]] = []


@contextlib.contextmanager
def lora_step(groups: list[tuple[int, torch.Tensor]]) -> Iterator[None]:
    """Apply each slot's adapter to its rows in the forward run inside the block."""
    global _groups
    previous, _groups = _groups, groups
    try:
        yield
    finally:
        _groups = previous


class LoRASlots:
    """Every adapter slot's A and B for one linear layer of ``input_size`` inputs whose
    outputs are ``part_sizes`` (the fused projections, top to bottom)."""

    def __init__(self, input_size: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self.max_rank = max_rank
        rank = len(part_sizes) * max_rank
        self.a = torch.zeros(max_loras, rank, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(part_sizes), rank, dtype=dtype, device=device)
        self.active = [False] * max_loras

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor,
             scale: float) -> None:
        """Projection ``part``'s A (r, K) and B (N_part, r) into ``slot``."""
        rank = a.shape[0]
        first = part * self.max_rank
        rows = slice(self.part_offsets[part], self.part_offsets[part] + self.part_sizes[part])
        self.a[slot, first:first + rank] = a.to(self.a.dtype)
        self.b[slot, rows, first:first + rank] = (b.float() * scale).to(self.b.dtype)
        self.active[slot] = True

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.active[slot] = False

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (T, N) += each of this step's groups' adapter on its rows of ``x`` (T, K)."""
        for slot, rows in _groups:
            if not self.active[slot]:
                continue  # the adapter does not target this layer
            xs = x.index_select(0, rows).to(self.a.dtype)
            delta = (xs @ self.a[slot].t()) @ self.b[slot].t()
            y.index_add_(0, rows, delta.to(y.dtype))
