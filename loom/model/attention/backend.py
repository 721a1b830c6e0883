"""The attention backend interface.

A backend instance serves one attention layer. Each forward it

1. writes the new tokens' K/V into the layer's paged cache at ``slot_mapping``, and
2. computes causal attention of the new queries over each request's whole context
   (cached tokens plus the new ones), read through ``block_table``.

The KV cache of one layer is ``(2, num_kv_heads, num_blocks, block_size, head_dim)``:
index 0 holds keys, 1 values; slot ``s`` is ``(s // block_size, s % block_size)``.
Heads outermost, so that gathering a context's slots gives each head's keys as one
contiguous ``(S, head_dim)`` matrix, ready for a matmul.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from loom.model.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        """``query`` (T, H, D), ``key``/``value`` (T, Hkv, D) for the step's new tokens;
        returns (T, H, D).

        With ``kv_cache`` None (a profiling run before the cache exists) each
        request's new tokens attend only to themselves, causally."""
