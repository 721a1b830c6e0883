"""The paged KV cache layout, stated once.

One attention layer's cache is one contiguous tensor

    (2, num_kv_heads, num_blocks, block_size, row)
     │  │             │           │           └ one token's vector of one head
     │  │             │           └ offset in the block: position % block_size
     │  │             └ block id: block_table[request][position // block_size]
     │  └ KV head (of this rank)
     └ KEY (0) or VALUE (1)

A new token's slot (``AttentionMetadata.slot_mapping``) is
``block_id * block_size + offset``; slot ``s`` is block ``s // block_size``, offset
``s % block_size``. In memory, with ``num_slots = num_blocks * block_size``:

    | K head 0: slot 0 .. num_slots-1 | K head 1 | ... | V head 0 | ... | V head Hkv-1 |

Heads outside blocks, so that each head's slots are the rows of one
``(num_slots, head_dim)`` matrix: gathering a context's slots gives each head's keys
as one contiguous ``(S, head_dim)`` matrix, ready for a matmul. The native kernels
address K of head ``h`` at slot ``s`` at element ``(h * num_slots + s) * row`` and
its V at ``((num_kv_heads + h) * num_slots + s) * row`` (``csrc/cache.cpp``,
``csrc/attention.cpp``). tests/model/test_kv_layout.py holds the allocation and every
backend's KV write to this map.

A row is ``head_dim`` elements in the cache's dtype: the model's, or bfloat16
(``--kv-cache-dtype``). A quantized cache (int8, fp8_e4m3 or fp8_e5m2) quantizes each
(token, head) vector on its own and keeps its scale beside it, in the row:

    | q_0 .. q_{head_dim-1}: one byte each | scale: float32, as 4 bytes |  row = head_dim + 4

    scale = max(max |x| / QMAX, FLT_MIN)     q = round_half_even(x / scale)
    x ~ q * scale   (float32, then rounded once to the model's dtype)

The cache tensor's dtype names the values' format (``KV_ROW_FORMATS``): int8 (QMAX 127,
q an integer in [-127, 127]), torch.float8_e4m3fn (QMAX 448, q rounded to E4M3) or
torch.float8_e5m2 (QMAX 57344, q rounded to E5M2); |x / scale| <= QMAX, so nothing
overflows, and an all-zero vector is zeros with scale FLT_MIN.

The kernels (``csrc/common.h``: ``quantize_kv_row``, ``dequantize_kv_row``) and the torch
backend (``quantize_kv_rows``, ``dequantize_kv_rows``) compute it bit for bit alike. A
scale per token rather than per block keeps a new token from rescaling its block's
earlier ones, and costs 4 bytes per head_dim bytes (6% at head_dim 64). A block is
still one run of bytes per (kind, head), so a KV transfer ships the scales with it.

This module imports no torch: the API process sizes the cache from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KEY, VALUE = 0, 1
KV_SCALE_BYTES = 4  # a quantized row's float32 scale
# --kv-cache-dtype names of the quantized row formats -> (torch dtype name, QMAX); fp8 is
# vLLM's name for fp8_e4m3
KV_ROW_FORMATS = {"int8": ("int8", 127.0), "fp8_e4m3": ("float8_e4m3fn", 448.0),
                  "fp8": ("float8_e4m3fn", 448.0), "fp8_e5m2": ("float8_e5m2", 57344.0)}


def kv_cache_row(head_dim: int, quantized: bool = False) -> int:
    """Elements of one (token, head) row: ``head_dim``, and in a quantized cache its
    scale's 4 bytes after the values."""
    return head_dim + KV_SCALE_BYTES if quantized else head_dim


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   quantized: bool = False) -> tuple[int, int, int, int, int]:
    """One layer's cache shape; the model runner allocates it, backends read it."""
    return (2, num_kv_heads, num_blocks, block_size, kv_cache_row(head_dim, quantized))


def kv_cache_index(kind: int, kv_head: int, slot: int,
                   block_size: int) -> tuple[int, int, int, int]:
    """Where ``kind`` (KEY or VALUE) of ``kv_head`` for the token in ``slot`` lies:
    index a layer's cache with it for that token's ``(head_dim,)`` vector."""
    return (kind, kv_head, slot // block_size, slot % block_size)


def slot_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` viewed as ``(2, num_kv_heads, num_slots, row)``: row ``s`` of a
    head is slot ``s``. A view; writing through it writes the cache."""
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    return kv_cache.view(2, num_kv_heads, num_blocks * block_size, row)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for ``--kv-cache-dtype`` ``name`` (config.py's
    KV_CACHE_DTYPES) under a model in ``model_dtype``."""
    import torch

    if name in KV_ROW_FORMATS:
        return getattr(torch, KV_ROW_FORMATS[name][0])
    return {"auto": model_dtype, "bfloat16": torch.bfloat16}[name]


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache in ``dtype`` holds quantized rows (values, then a scale)."""
    return str(dtype).removeprefix("torch.") in _QUANTIZED_DTYPES


def kv_row_qmax(dtype: torch.dtype) -> float:
    """QMAX of a quantized cache's dtype: a row's scale is max |x| / QMAX."""
    return _QUANTIZED_DTYPES[str(dtype).removeprefix("torch.")]


_QUANTIZED_DTYPES = dict(KV_ROW_FORMATS.values())
