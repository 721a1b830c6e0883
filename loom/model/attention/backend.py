"""The attention backend interface.

A backend instance serves one attention layer. Each forward it

1. writes the new tokens' K/V into the layer's paged cache at ``slot_mapping`` (in the
   cache's dtype: the model's, bfloat16, or int8 / fp8 quantized per token and head), and
2. computes causal attention of the new queries over each request's whole context
   (cached tokens plus the new ones), read through ``block_table``; a layer with a
   ``sliding_window`` W masks the keys more than W - 1 positions behind each query.

The layer's cache is laid out as ``kv_layout.py`` declares (``kv_cache_shape``, with
its region map); the model sizes the allocation through ``AttentionBackend.kv_cache_shape``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from loom.model.attention.kv_layout import kv_cache_shape
from loom.model.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # A query at position p sees keys p - sliding_window + 1 .. p (Hugging Face's
        # sliding_window: the window counts the query itself); None: keys 0 .. p.
        self.sliding_window = sliding_window

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       quantized: bool = False) -> tuple[int, ...]:
        """The shape of this layer's cache tensor, which ``forward`` then receives; an
        int8 or fp8 cache (``quantized``) has each row's scale beside it."""
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim,
                              quantized)

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        """``query`` (T, H, D), ``key``/``value`` (T, Hkv, D) for the step's new tokens;
        returns (T, H, D).

        With ``kv_cache`` None (a profiling run before the cache exists) each
        request's new tokens attend only to themselves, causally."""
