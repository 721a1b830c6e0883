"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into equal
contiguous ranges, one per rank. Padded rows are zero and their logits are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.linear import PackedWeight, linear, pack_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tp_group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        tp = tp_group.world_size
        self.num_embeddings_per_rank = -(-num_embeddings // tp)
        self.vocab_start = tp_group.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings or \
                loaded_weight.shape[1] != param.shape[1]:
            raise ValueError(f"embedding of shape {tuple(loaded_weight.shape)} does not match "
                             f"vocab_size {self.num_embeddings} x {param.shape[1]}")
        end = min(self.vocab_end, self.num_embeddings)
        rows = max(end - self.vocab_start, 0)
        param.data[:rows].copy_(loaded_weight[self.vocab_start:self.vocab_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.is_single:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its range, zeroes the others; the sum is the lookup.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        out = F.embedding(local_ids, self.weight)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocab range and the
    ranges are gathered so every rank returns the full ``(N, vocab_size)``."""

    packed_weight: PackedWeight | None = None  # see linear.pack_weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits")

    def process_weights_after_loading(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (N, vocab); float32 straight from the sums where the CPU kernel allows (bf16
        # logits tie tokens one bf16 step, 0.125 at 25, apart), in a buffer kept from
        # step to step (layers/scratch.py): valid until this head's next call
        logits = linear(hidden_states, self.weight, packed=self.packed_weight,
                        float_output=True, out_owner=self)
        logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()
