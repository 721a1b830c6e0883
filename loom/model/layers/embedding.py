"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into equal
contiguous ranges, one per rank. Padded rows are zero and their logits are cut off.

A table that arrives quantized (a GGUF file's Q8_0 ``token_embd`` under ``--quantization
auto``) stays quantized, and under ``--quantization wint8|wint4`` a full-precision one is
quantized as it loads (``table_quantization``): the embedding gathers and dequantizes
the rows it looks up, and the LM head (often the same table, tied) multiplies with
loom's quantized kernel, or in float32 with ``--lm-head-fp32``
(``ParallelLMHead.float32``). The quantized state hangs on the ``weight`` parameter
itself (``QuantizedTable``), so a tied head shares it.

A bf16 table on a CPU with loom's kernels is held once, as the LM head's ``bf16_linear``
panels (the parameter's ``panels``): a tied embedding gathers its rows from them
(``PackedWeight.rows``), so no plain copy stays beside them (192 MiB for a 1B model's
49,152 x 2,048 table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.kernels import native_ops_for
from loom.model.layers.weight_forms import PackedWeight, linear, pack_weight
from loom.model.layers.quantization import (QuantizedTensor, quantize_wint8,
                                            reference_linear)


class QuantizedTable:
    """A quantized (rows, K) table as one of the two paths holds it: loom's kernel layout
    (``kernel``, a ``QuantizedWeight``) or the PyTorch path's ``QuantizedTensor``."""

    def __init__(self, staged: QuantizedTensor, dtype: torch.dtype) -> None:
        self.format = staged.format
        ops = native_ops_for(staged.values.device, dtype)
        if ops is not None and dtype == torch.bfloat16 and ops.quant_gemm_available():
            self.kernel = staged.pack(ops)
            self.reference, self._ops = None, ops
        else:
            # the PyTorch path: values bit-packed; rows gathered packed, then unpacked
            self.kernel, self.reference, self._ops = None, staged.held(), None

    @property
    def data(self) -> torch.Tensor:
        """The bytes that stay resident (what the ``weight`` parameter holds)."""
        return self.kernel.data if self.kernel is not None else self.reference.values

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        if self.kernel is None:
            out = self.reference.rows(flat).dequantize(dtype)
        else:
            out = torch.empty(flat.numel(), self.kernel.in_features, dtype=dtype)
            self._ops.dequantize_rows(out, self.kernel, flat)
        return out.view(*ids.shape, out.shape[-1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, K) -> float32 (N, rows)."""
        if self.kernel is None:
            return reference_linear(hidden.float(), self.reference)
        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        out = torch.empty(flat.shape[0], self.kernel.out_features, dtype=torch.float32)
        self._ops.quantized_linear(out, flat, self.kernel, None)
        return out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel is None:
            return self.reference.dequantize(dtype)
        ids = torch.arange(self.kernel.out_features)
        return self.rows(ids, dtype)


class VocabParallelEmbedding(nn.Module):
    # "wint8": a full-precision table is quantized per row as it loads (load_model sets
    # it under --quantization wint8/wint4, see table_quantization); None keeps it
    table_quantization: str | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tp_group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        tp = tp_group.world_size
        self.num_embeddings_per_rank = -(-num_embeddings // tp)
        self.vocab_start = tp_group.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # the model's device: a table loaded from the file (on the CPU) is held there
        self._dtype, self._device = self.weight.dtype, self.weight.device

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantizedTensor,
                      shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings or \
                loaded_weight.shape[1] != self.embedding_dim:
            raise ValueError(f"embedding of shape {tuple(loaded_weight.shape)} does not match "
                             f"vocab_size {self.num_embeddings} x {self.embedding_dim}")
        end = min(self.vocab_end, self.num_embeddings)
        rows = max(end - self.vocab_start, 0)
        mine = loaded_weight.narrow(0, self.vocab_start, rows)
        if self.table_quantization == "wint8" and not isinstance(mine, QuantizedTensor) \
                and not mine.is_meta:
            # per row: this rank's rows alone give TP=1's values
            mine = quantize_wint8(mine)
        if isinstance(mine, QuantizedTensor):  # kept quantized
            if rows == self.num_embeddings_per_rank:
                staged = mine.to(self._device)  # the whole table (TP=1): no copy on a CPU
            else:
                staged = QuantizedTensor.empty(mine, (self.num_embeddings_per_rank,
                                                      self.embedding_dim), self._device)
                staged.narrow(0, 0, rows).copy_(mine)
            param.staged = staged
            param.panels = None
            if not staged.values.is_meta:
                # laid out now, not after the whole model: the table's values (a byte
                # each) are not held beside every other layer's
                VocabParallelEmbedding.process_weights_after_loading(self)
            return
        plain = (self.num_embeddings_per_rank, self.embedding_dim)
        if getattr(param, "table", None) is not None or tuple(param.shape) != plain:
            # was quantized or the head's panels (or freed in their shape): plain again
            param.data = torch.zeros(plain, dtype=self._dtype, device=self._device)
            param.table = None
        param.panels = None
        param.data[:rows].copy_(mine)
        param.data[rows:].zero_()

    def process_weights_after_loading(self) -> None:
        staged = getattr(self.weight, "staged", None)
        if staged is not None:
            self.weight.table = QuantizedTable(staged, self._dtype)
            self.weight.data = self.weight.table.data  # the float table is freed
            self.weight.staged = None

    @property
    def table(self) -> QuantizedTable | None:
        """The quantized table, None when the weight is full precision."""
        return getattr(self.weight, "table", None)

    @property
    def panels(self) -> PackedWeight | None:
        """The table as loom's bf16 panels, when an LM head's matmul layout is the only
        copy held (``ParallelLMHead.process_weights_after_loading``: the head's table, and
        the embedding's when tied to it); else None."""
        return getattr(self.weight, "panels", None)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        table, panels = self.table, self.panels
        if table is not None:
            return table.rows(ids, self._dtype)
        return F.embedding(ids, self.weight) if panels is None else panels.rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.is_single:
            return self._lookup(input_ids)
        # Each rank looks up the ids in its range, zeroes the others; the sum is the lookup.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        out = self._lookup(local_ids)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocab range and the
    ranges are gathered so every rank returns the full ``(N, vocab_size)``."""

    packed_weight: PackedWeight | None = None  # see linear.pack_weight
    # --lm-head-fp32 (the seed's): logits from a float32 copy of the weight and float32
    # hidden states, however the table is held (load_model sets it)
    float32: bool = False
    float32_weight: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits")

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()  # a tied table: done already, a no-op
        table, panels = self.table, self.panels
        self.packed_weight = None
        self.float32_weight = None
        if self.float32:
            self.float32_weight = (table.dequantize(torch.float32) if table is not None
                                   else (self.weight if panels is None
                                         else panels.plain()).detach().float())
        elif panels is not None:  # packed before, and not reloaded since
            self.packed_weight = panels
        elif table is None:
            self.packed_weight = pack_weight(self.weight)
            if self.packed_weight is not None and self.packed_weight.is_loom_kernel:
                # loom's panels become the table (a tied embedding gathers its rows from
                # them, PackedWeight.rows): no second copy of it stays resident
                self.weight.data = self.packed_weight.data
                self.weight.panels = self.packed_weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (N, vocab); float32 straight from the sums where the CPU kernel allows (bf16
        # logits tie tokens one bf16 step, 0.125 at 25, apart), in a buffer kept from
        # step to step (layers/scratch.py): valid until this head's next call
        table = self.table
        if self.float32_weight is not None:
            logits = F.linear(hidden_states.float(), self.float32_weight)
        elif table is not None:
            logits = table.logits(hidden_states)
        else:
            logits = linear(hidden_states, self.weight, packed=self.packed_weight,
                            float_output=True, out_owner=self)
        logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()
