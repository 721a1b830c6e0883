"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into equal
contiguous ranges, one per rank. Padded rows are zero and their logits are cut off.

A table that arrives quantized (a GGUF file's Q8_0 ``token_embd`` under ``--quantization
auto``) stays quantized, and under ``--quantization wint8|wint4`` a full-precision one is
quantized as it loads (``table_quantization``): the embedding gathers and dequantizes
the rows it looks up, and the LM head (often the same table, tied) multiplies with
loom's quantized kernel, or in float32 with ``--lm-head-fp32``
(``ParallelLMHead.float32``).

A table is held in one of the linear layers' weight forms (weight_forms.py), which
hangs on the ``weight`` parameter itself (``weight.form``), so a tied head shares it:
plain as loaded, quantized (``QuantizedKernel`` or ``QuantizedReference``, as
``select_form`` picks), or, once the LM head has packed it, loom's ``bf16_linear``
panels (``Bf16Panels``) on a CPU with loom's kernels: a tied embedding gathers its rows
from them (``WeightForm.rows``), so no plain copy stays beside them (192 MiB for a 1B
model's 49,152 x 2,048 table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.quantization import QuantizedTensor, quantize_wint8
from loom.model.layers.weight_forms import (Bf16Panels, OneDnnWeight, PlainWeight,
                                            QuantizedKernel, QuantizedReference, RowBlocks,
                                            WeightForm, full_precision_form, linear,
                                            select_form)


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
        self.weight.form = PlainWeight(self.weight)
        # the model's device: a table loaded from the file (on the CPU) is held there
        self._dtype, self._device = self.weight.dtype, self.weight.device
        # LoRA adapters on the table (layers/lora.py), once an adapter served targets it:
        # EmbeddingLoRASlots on an embedding, LoRASlots on an LM head
        self.lora: nn.Module | None = None

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
            if not staged.values.is_meta:
                # laid out now, not after the whole model: the table's values (a byte
                # each) are not held beside every other layer's
                VocabParallelEmbedding.process_weights_after_loading(self)
            return
        plain = (self.num_embeddings_per_rank, self.embedding_dim)
        if not isinstance(param.form, PlainWeight) or tuple(param.shape) != plain:
            # was quantized or the head's panels (or freed in their shape): plain again
            param.data = torch.zeros(plain, dtype=self._dtype, device=self._device)
        param.form = PlainWeight(param)  # (oneDNN's copy, if any, is stale now)
        param.data[:rows].copy_(mine)
        param.data[rows:].zero_()

    def process_weights_after_loading(self) -> None:
        staged = getattr(self.weight, "staged", None)
        if staged is not None:
            self.weight.form = select_form(RowBlocks([staged]), self._device, self._dtype)
            # the quantized bytes are the parameter; the float table is freed
            self.weight.data = self.weight.form.tensors()["weight"]
            self.weight.staged = None

    @property
    def form(self) -> WeightForm:
        """How the table is held (shared with a tied LM head)."""
        return self.weight.form

    @property
    def table(self) -> QuantizedKernel | QuantizedReference | None:
        """The quantized table's form, None when the weight is full precision."""
        form = self.weight.form
        return form if isinstance(form, (QuantizedKernel, QuantizedReference)) else None

    @property
    def panels(self) -> Bf16Panels | None:
        """The table as loom's bf16 panels, when an LM head's matmul layout is the only
        copy held (``ParallelLMHead.process_weights_after_loading``: the head's table, and
        the embedding's when tied to it); else None."""
        form = self.weight.form
        return form if isinstance(form, Bf16Panels) else None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.form.rows(ids, self._dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.is_single:
            out = self._lookup(input_ids)
        else:
            # Each rank looks up the ids in its range, zeroes the others; the sum is the
            # lookup.
            in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = (input_ids - self.vocab_start) * in_range
            out = self._lookup(local_ids)
            out.masked_fill_(~in_range.unsqueeze(-1), 0)
            out = self.tp_group.all_reduce(out)
        if self.lora is not None:
            self.lora.add(input_ids, out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocab range and the
    ranges are gathered so every rank returns the full ``(N, vocab_size)``."""

    # --lm-head-fp32 (the seed's): logits from a float32 copy of the weight and float32
    # hidden states, however the table is held (load_model sets it)
    float32: bool = False
    float32_weight: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits")

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()  # a tied table: done already, a no-op
        form = self.weight.form
        self.float32_weight = None
        if self.float32:
            self.float32_weight = (form.dequantize(torch.float32) if self.table is not None
                                   else form.plain().detach().float())
        elif type(form) is PlainWeight:  # loaded (or reloaded) since it was last packed
            form, _ = full_precision_form(self.weight)
            if isinstance(form, Bf16Panels):
                # loom's panels become the table (a tied embedding gathers its rows from
                # them): no second copy of it stays resident
                self.weight.data = form.packed.data
            self.weight.form = form

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (N, vocab); float32 straight from the sums where the CPU kernel allows (bf16
        # logits tie tokens one bf16 step, 0.125 at 25, apart), in a buffer kept from
        # step to step (layers/scratch.py): valid until this head's next call
        form = self.weight.form
        if self.float32_weight is not None:
            logits = F.linear(hidden_states.float(), self.float32_weight)
        elif self.table is not None:
            logits = form.apply(hidden_states, None, float_output=True)
        else:
            packed = form.packed if isinstance(form, (Bf16Panels, OneDnnWeight)) else None
            logits = linear(hidden_states, self.weight, packed=packed, float_output=True,
                            out_owner=self)
        if self.lora is not None and self.lora.rows is not None:
            # the LoRA adapters of the rows' requests (the runner names each row's slot)
            self.lora.add(hidden_states, logits, self.lora.rows)
        logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()
