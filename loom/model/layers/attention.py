"""The attention layer: owns this layer's bound KV cache and its backend instance.

``backend`` is a registered name (``loom.model.attention``), already resolved from
``auto`` by whoever builds the model (``load_model``)."""

from __future__ import annotations

import torch
from torch import nn

from loom.model.attention import get_attn_backend
from loom.model.attention.metadata import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, backend: str = "torch",
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.impl = get_attn_backend(backend)(num_heads, num_kv_heads, head_dim, scale,
                                              sliding_window)
        # Shaped by kv_cache_shape below (layout: kv_layout.py); bound by the model runner,
        # with the KV cache group whose block tables it reads (kv_cache_groups.py).
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0
        # MoBA (attention/moba.py: enable_moba), which then runs this layer's attention
        self.moba: nn.Module | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       quantized: bool = False) -> tuple[int, ...]:
        """This layer's cache, as its backend lays it out."""
        return self.impl.kv_cache_shape(num_blocks, block_size, quantized)

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """``query`` (T, H, D) or (T, H*D), ``key``/``value`` likewise with Hkv heads; views
        with strided rows are fine. Returns (T, H*D)."""
        num_tokens = query.shape[0]
        out = (self.impl if self.moba is None else self.moba).forward(
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache, get_forward_context().for_group(self.kv_cache_group))
        return out.view(num_tokens, self.num_heads * self.head_dim)
