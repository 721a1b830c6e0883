"""The paged KV cache layout, stated once.

One attention layer's cache is one contiguous tensor

    (2, num_kv_heads, num_blocks, block_size, head_dim)
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
address K of head ``h`` at slot ``s`` at element ``(h * num_slots + s) * head_dim`` and
its V at ``((num_kv_heads + h) * num_slots + s) * head_dim`` (``csrc/cache.cpp``,
``csrc/attention.cpp``). tests/model/test_kv_layout.py holds the allocation and every
backend's KV write to this map.
"""

from __future__ import annotations

import torch

KEY, VALUE = 0, 1


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int, int]:
    """One layer's cache shape; the model runner allocates it, backends read it."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def kv_cache_index(kind: int, kv_head: int, slot: int,
                   block_size: int) -> tuple[int, int, int, int]:
    """Where ``kind`` (KEY or VALUE) of ``kv_head`` for the token in ``slot`` lies:
    index a layer's cache with it for that token's ``(head_dim,)`` vector."""
    return (kind, kv_head, slot // block_size, slot % block_size)


def slot_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``kv_cache`` viewed as ``(2, num_kv_heads, num_slots, head_dim)``: row ``s`` of a
    head is slot ``s``. A view; writing through it writes the cache."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    return kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
