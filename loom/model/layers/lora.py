"""LoRA on a linear layer, batched (loom/lora.py): ``y += scale * B (A x)`` per row, by the
adapter of the request the row belongs to, never merged into the base weight.

A ``LoRASlots`` hangs on a ``LinearBase`` (``linear.lora``) and holds every adapter slot's
A and B for it: for a fused layer (q|k|v, gate|up) one A per projection stacked along
the rank, and B block-diagonal (projection p's rank rows write only its output columns),
held transposed, (rank, outputs), the scale folded in. The model runner says, for each
step, which slot each token row runs (``AttentionMetadata.lora_slots``: -1 for the base).
On the CPU, loom's ``lora_add`` kernel adds them in one pass over the rows (Punica's
BGMV; a recorded forward replays it: kernel_replay.py): each row's shrink ``h = A x`` in
float32, then its expand ``y += h B``, parallel over output columns, where a fused
layer's parts (``part_sizes``) read only their own rank rows of B (the zero blocks are
skipped). Each row's sums run in an order fixed by the shapes alone, so a row's result
does not depend on the other rows of the batch. Elsewhere (CUDA) the same product runs
in PyTorch, rows grouped by adapter (Punica's segments), one shrink and one expand
matmul per group. Rows of the base model and steps without adapters cost one pass over
the slots.

The LM head takes a ``LoRASlots`` too (its rows are the hidden states whose logits the
runner asks for, so their slots come with the call: ``rows``), and the token embeddings
an ``EmbeddingLoRASlots``: PEFT's embedding adapter is ``B A^T[id]``, a gather of A's
column for each token (the shrink) and the same expand, by ``lora_embedding_add``.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.kernels import native_ops_for
from loom.model.attention.metadata import get_forward_context


class LoRASlots(nn.Module):
    """Every adapter slot's A and B for one linear layer of ``input_size`` inputs whose
    outputs are ``part_sizes`` (the fused projections, top to bottom); buffers, so that
    a recorded forward holds them as the model's own."""

    def __init__(self, input_size: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self.max_rank = max_rank
        rank = len(part_sizes) * max_rank
        self.register_buffer("a", torch.zeros(max_loras, rank, input_size, dtype=dtype,
                                              device=device), persistent=False)
        # B transposed, (rank, outputs) per slot: the expand's rows are B's
        self.register_buffer("b", torch.zeros(max_loras, rank, sum(part_sizes), dtype=dtype,
                                              device=device), persistent=False)
        # the slots whose adapter targets this layer (the others' rows are left alone)
        self.register_buffer("active", torch.zeros(max_loras, dtype=torch.bool, device=device),
                             persistent=False)
        # an LM head's: the slot of each row its next compute_logits gets (the runner's)
        self.rows: torch.Tensor | None = None

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor,
             scale: float) -> None:
        """Projection ``part``'s A (r, K) and B (N_part, r) into ``slot``."""
        rank = a.shape[0]
        first = part * self.max_rank
        rows = slice(self.part_offsets[part], self.part_offsets[part] + self.part_sizes[part])
        self.a[slot, first:first + rank] = a.to(self.a.dtype)
        self.b[slot, first:first + rank, rows] = (b.float() * scale).t().to(self.b.dtype)
        self.active[slot] = True

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.active[slot] = False

    def add(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """``y`` (T, N) += the step's adapters on their rows of ``x`` (T, K); ``slots``:
        each row's slot (default: the step's, from the forward context)."""
        if slots is None:
            slots = get_forward_context().lora_slots
            if slots is None:
                return
        ops = native_ops_for(x.device, x.dtype)
        if ops is not None:
            ops.lora_add(y, x, self.a, self.b, slots, self.active, self.part_sizes)
            return
        for slot, rows in _groups(slots, self.active):
            xs = x.index_select(0, rows).to(self.a.dtype)
            delta = (xs @ self.a[slot].t()) @ self.b[slot]
            y.index_add_(0, rows, delta.to(y.dtype))


class EmbeddingLoRASlots(nn.Module):
    """Every adapter slot's embedding LoRA for a table of ``num_embeddings`` rows of
    ``embedding_dim``: A transposed, (vocabulary, rank), so a token's shrink is its row,
    and B transposed, (rank, embedding_dim), with the scale folded in. Each rank holds all of it (a
    tensor-parallel embedding adds it after its all-reduce)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.register_buffer("a_t", torch.zeros(max_loras, num_embeddings, max_rank,
                                                dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(max_loras, max_rank, embedding_dim, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("active", torch.zeros(max_loras, dtype=torch.bool, device=device),
                             persistent=False)

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """PEFT's ``lora_embedding_A`` (r, V) and ``lora_embedding_B`` (D, r) into ``slot``."""
        rank = a.shape[0]
        self.a_t[slot, :, :rank] = a.t().to(self.a_t.dtype)
        self.b[slot, :rank] = (b.float() * scale).t().to(self.b.dtype)
        self.active[slot] = True

    def clear(self, slot: int) -> None:
        self.a_t[slot].zero_()
        self.b[slot].zero_()
        self.active[slot] = False

    def add(self, ids: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (T, D), the embeddings of ``ids`` (T,), += the step's adapters on their rows."""
        slots = get_forward_context().lora_slots
        if slots is None:
            return
        ops = native_ops_for(y.device, y.dtype)
        if ops is not None:
            ops.lora_embedding_add(y, ids, self.a_t, self.b, slots, self.active)
            return
        for slot, rows in _groups(slots, self.active):
            shrunk = self.a_t[slot].index_select(0, ids.index_select(0, rows))
            y.index_add_(0, rows, (shrunk @ self.b[slot]).to(y.dtype))


def _groups(slots: torch.Tensor, active: torch.Tensor):
    """(slot, its rows) for each slot some row runs whose adapter targets this layer."""
    for slot in slots[slots >= 0].unique().tolist():
        if active[slot]:
            yield slot, (slots == slot).nonzero().flatten()
