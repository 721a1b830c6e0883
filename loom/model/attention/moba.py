"""MoBA, mixture of block attention (``--moba-attention-config``), over the paged KV cache.

The algorithm is the MoBA paper's (MoonshotAI/MoBA, ``moba_attn_varlen_naive``), under
FastDeploy's ``moba_attention_config``. A request's keys are split into blocks of
B = ``moba_block_size`` positions. A query at position p whose context (p + 1 keys) is
at least ``moba_min_seq_len``

- attends to its own block c = p // B causally (keys c*B .. p),
- scores each earlier block m < c (complete: all its B keys are written) by
  q . mean(K of block m), its block's mean key, per query head (the raw dot, float32),
- and attends as well to the ``moba_topk - 1`` highest-scoring of those (all of them if
  there are fewer); the own block counts as one of the ``moba_topk``, as in the paper,
  whose gate gives it +inf. Equal gates: the earlier block first.

One softmax, with the layer's scale, over the union. A query below the minimum attends to
every key up to its own (full attention). GQA: query head h reads KV head h // G, and
each query head chooses its blocks on its own, as the paper's reference does over K
repeated per head (FastDeploy's decode kernel instead pools a group's choices). A layer
with a sliding window keeps its window and takes no MoBA (``enable_moba``).

Block means live beside the cache, per layer: ``MobaAttention.block_means``
``(num_kv_heads, num_blocks, head_dim)`` float32, block m's mean at the KV cache block
holding its last position, ``block_table[(m + 1) * B // block_size - 1]`` (B is a
multiple of the cache's block size, config.py checks it). The step that writes a
block's last position computes its mean from the cache (after writing the step's K/V),
so a recomputed block or an overwritten draft gets a fresh one; a prefix-cache hit
reuses it, a block's contents and position being its hash chain's. Sizing counts it
(``ModelRunner.kv_cache_bytes_per_block``: head_dim float32s per KV head and block).

Two paths, one algorithm. On the CPU with loom's kernels (the ``cpu`` backend, float32
or bfloat16) ``moba_update_block_means`` and ``moba_attention`` (``csrc/moba.cpp``) take
every decision in C++ from the step's tensors, so a replayed forward
(``kernel_replay.py``) decides anew each step. Elsewhere the PyTorch path below, the
reference: a step whose contexts are all below the minimum runs the backend's own
attention; otherwise each query's chosen blocks are gathered from the cache (tiles of
queries, at most ``_GATHER_BYTES`` of K/V at a time; no query x context score matrix
above the minimum) and its rows below the minimum attend densely. Both read the cache
in its dtype (bfloat16, int8 or fp8: dequantized) and compute in float32.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.kernels import native_ops_for
from loom.model.attention.kv_layout import KEY, VALUE, is_quantized_kv, slot_rows
from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.torch_backend import TorchAttentionBackend, dequantize_kv_rows

if TYPE_CHECKING:
    from loom.config import MobaAttentionConfig
    from loom.model.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

# The PyTorch path's temporaries of one tile of queries (their gathered K and V in
# float32, indices, scores): well under glibc's largest mmap threshold, 32 MiB
# (worker/memory.py), so that a tile reuses the last one's pages
_GATHER_BYTES = 16 << 20
# A request with more new queries (at the minimum) than this runs as a chunk (_chunk:
# its context read once, each chosen block multiplied with its rows); fewer are
# gathered, each query's chosen blocks on their own (_sparse: decodes, drafts)
_GATHERED_QUERIES = 8


class MobaAttention(nn.Module):
    """MoBA for one attention layer, beside its backend (``Attention.moba``)."""

    def __init__(self, config: MobaAttentionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.block_size = config.moba_block_size
        self.topk = config.moba_topk
        self.min_seq_len = config.moba_min_seq_len
        self.backend = backend
        # (num_kv_heads, num_blocks, head_dim) float32, made for the bound cache
        self.block_means: torch.Tensor | None = None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of ``block_means`` per KV cache block."""
        return self.backend.num_kv_heads * self.backend.head_dim * 4

    def extra_repr(self) -> str:
        return (f"moba_block_size={self.block_size}, moba_topk={self.topk}, "
                f"moba_min_seq_len={self.min_seq_len}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> torch.Tensor:
        """As ``AttentionBackend.forward``: writes the step's K/V, returns (T, H, D)."""
        backend = self.backend
        if kv_cache is None:  # the profiling run: each request's tokens among themselves
            return backend.forward(query, key, value, kv_cache, metadata)
        if metadata.bidirectional_spans:
            raise NotImplementedError("MoBA (--moba-attention-config) does not take images "
                                      "whose tokens attend to each other both ways")
        means = self._means_for(kv_cache)
        ops = native_ops_for(query.device, query.dtype) if backend.name == "cpu" else None
        if ops is not None:
            ops.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            ops.moba_update_block_means(means, kv_cache, metadata.block_table,
                                        metadata.seq_lens, metadata.query_start_loc,
                                        self.block_size)
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            ops.moba_attention(output, query, kv_cache, means, metadata.block_table,
                               metadata.seq_lens, metadata.query_start_loc, backend.scale,
                               self.block_size, self.topk, self.min_seq_len)
            return output
        if metadata.max_seq_len < self.min_seq_len:  # full attention for every query
            output = backend.forward(query, key, value, kv_cache, metadata)
            update_block_means(means, kv_cache, metadata, self.block_size)
            return output
        TorchAttentionBackend._write_kv(key, value, kv_cache, metadata.slot_mapping)
        update_block_means(means, kv_cache, metadata, self.block_size)
        return moba_attention(query, kv_cache, means, metadata, backend.scale,
                              self.block_size, self.topk, self.min_seq_len)

    def _means_for(self, kv_cache: torch.Tensor) -> torch.Tensor:
        _, kv_heads, num_blocks, _, _ = kv_cache.shape
        shape = (kv_heads, num_blocks, self.backend.head_dim)
        means = self.block_means
        if means is None or means.shape != shape or means.device != kv_cache.device:
            # never read before written: a block's mean is written with its last key
            means = self.block_means = torch.zeros(shape, dtype=torch.float32,
                                                   device=kv_cache.device)
        return means


def enable_moba(model: nn.Module, config: MobaAttentionConfig) -> int:
    """Give each attention layer of ``model`` without a sliding window a
    ``MobaAttention``; returns how many took it."""
    layers = [layer for layer in getattr(model, "attention_layers", ())
              if layer.sliding_window is None]
    for layer in layers:
        layer.moba = MobaAttention(config, layer.impl)
    return len(layers)


def describe_moba(config: MobaAttentionConfig, layers: int, total: int) -> None:
    """The start-up line: where MoBA runs and how."""
    if layers == 0:
        logger.warning("--moba-attention-config: no attention layer of this model takes "
                       "MoBA (a sliding window, which it keeps, or no KV cache)")
        return
    logger.info("MoBA on %d of %d attention layers: blocks of %d tokens, %d per query (its "
                "own included), from contexts of %d tokens", layers, total,
                config.moba_block_size, config.moba_topk, config.moba_min_seq_len)


# ---------------------------------------------------------------- the PyTorch path


def _positions_to_slots(block_table: torch.Tensor, positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """Cache slots of ``positions`` (R, ...) of each row of ``block_table`` (R, W)."""
    flat = positions.reshape(positions.shape[0], -1)
    blocks = block_table.long().gather(1, flat // block_size)
    return (blocks * block_size + flat % block_size).view(positions.shape)


def _gather_rows(kv_cache: torch.Tensor, kind: int, kv_heads: torch.Tensor,
                 slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V (``kind``) of KV head ``kv_heads`` at ``slots`` (same shape), float32:
    (..., head_dim), read as the model's dtype sees the cache."""
    rows = slot_rows(kv_cache)[kind]  # (Hkv, num_slots, row)
    num_slots = rows.shape[1]
    flat = (kv_heads * num_slots + slots).reshape(-1)
    picked = rows.reshape(-1, rows.shape[-1]).index_select(0, flat)
    if is_quantized_kv(kv_cache.dtype):
        picked = dequantize_kv_rows(picked, dtype)
    else:
        picked = picked.to(dtype)
    return picked.float().view(*slots.shape, -1)


def update_block_means(means: torch.Tensor, kv_cache: torch.Tensor,
                       metadata: AttentionMetadata, moba_block_size: int) -> None:
    """The mean key of every MoBA block whose last position this step wrote, into
    ``means`` at the cache block holding that position (the module's doc): the keys in
    float32 (a quantized row's q * scale unrounded), summed in float32 and divided by B."""
    bs, per = metadata.block_size, moba_block_size // metadata.block_size
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    pairs = [(i, m) for i, seq_len in enumerate(lens)
             for m in range((seq_len - (starts[i + 1] - starts[i])) // moba_block_size,
                            seq_len // moba_block_size)]
    if not pairs:
        return
    device = kv_cache.device
    reqs = torch.tensor([i for i, _ in pairs], device=device)
    first = torch.tensor([m * moba_block_size for _, m in pairs], device=device)
    table = metadata.block_table[reqs]  # (N, W)
    positions = first[:, None] + torch.arange(moba_block_size, device=device)  # (N, B)
    slots = _positions_to_slots(table, positions, bs)
    kv_heads = kv_cache.shape[1]
    heads = torch.arange(kv_heads, device=device)[:, None, None]
    keys = _gather_rows(kv_cache, KEY, heads, slots.expand(kv_heads, -1, -1), torch.float32)
    targets = table.long().gather(1, (first[:, None] // bs) + per - 1)[:, 0]  # (N,)
    means.index_copy_(1, targets, keys.sum(dim=2) / moba_block_size)


def moba_attention(query: torch.Tensor, kv_cache: torch.Tensor, means: torch.Tensor,
                   metadata: AttentionMetadata, scale: float, moba_block_size: int,
                   topk: int, min_seq_len: int) -> torch.Tensor:
    """MoBA of the step's queries (T, H, D) over the cache (the step's K/V and block
    means already written); (T, H, D) in the query's dtype."""
    num_tokens, heads, head_dim = query.shape
    kv_heads = kv_cache.shape[1]
    group = heads // kv_heads
    device = query.device
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    output = torch.empty_like(query)
    sparse: list[tuple[int, int, int]] = []  # (token, request, position) at the minimum
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        first = seq_len - (end - start)
        # positions p < min_seq_len - 1 attend to everything before them
        dense = max(0, min(end - start, min_seq_len - 1 - first))
        if dense:
            output[start:start + dense] = _dense(query[start:start + dense], kv_cache,
                                                 metadata, i, first, scale)
        if end - start - dense > _GATHERED_QUERIES:
            output[start + dense:end] = _chunk(query[start + dense:end], kv_cache, means,
                                               metadata, i, first + dense, scale,
                                               moba_block_size, topk)
        else:
            sparse += [(start + j, i, first + j) for j in range(dense, end - start)]
    if not sparse:
        return output
    tokens = torch.tensor([t for t, _, _ in sparse], device=device)
    reqs = torch.tensor([r for _, r, _ in sparse], device=device)
    positions = torch.tensor([p for _, _, p in sparse], device=device)
    num_blocks = max(p for _, _, p in sparse) // moba_block_size  # earlier blocks, at most
    # the cache block holding each earlier MoBA block's mean, per request: (R, num_blocks)
    per = moba_block_size // metadata.block_size
    mean_at = metadata.block_table[:, per - 1::per][:, :num_blocks].long()
    row = (heads * topk * moba_block_size * (8 * head_dim + 40)  # per query
           + num_blocks * (kv_heads * head_dim + heads) * 4)
    tile = max(1, _GATHER_BYTES // row)
    q = query.float().view(num_tokens, kv_heads, group, head_dim)
    for lo in range(0, len(sparse), tile):
        t, r, p = tokens[lo:lo + tile], reqs[lo:lo + tile], positions[lo:lo + tile]
        output[t] = _sparse(q[t], kv_cache, means, metadata.block_table[r], mean_at[r], p,
                            scale, moba_block_size, metadata.block_size, topk,
                            query.dtype).to(query.dtype)
    return output


def _sparse(q: torch.Tensor, kv_cache: torch.Tensor, means: torch.Tensor,
            block_table: torch.Tensor, mean_at: torch.Tensor, positions: torch.Tensor,
            scale: float, moba_block_size: int, block_size: int, topk: int,
            dtype: torch.dtype) -> torch.Tensor:
    """MoBA rows: ``q`` (N, Hkv, G, D) float32 at ``positions`` (N,) of the requests whose
    tables are ``block_table`` (N, W) and means' blocks ``mean_at`` (N, num_blocks);
    returns (N, H, D) float32."""
    n, kv_heads, group, head_dim = q.shape
    device = q.device
    own = positions // moba_block_size  # (N,) the own block; earlier ones are complete
    earlier = min(topk - 1, mean_at.shape[1])
    blocks = own[:, None, None, None].expand(n, kv_heads, group, 1)
    chosen = torch.ones(blocks.shape, dtype=torch.bool, device=device)
    if earlier > 0:
        heads = torch.arange(kv_heads, device=device)[None, :, None]
        block_means = means[heads, mean_at[:, None, :]]  # (N, Hkv, num_blocks, D)
        gates = torch.einsum("nkgd,nkmd->nkgm", q, block_means)
        later = torch.arange(mean_at.shape[1], device=device) >= own[:, None]  # (N, nb)
        gates.masked_fill_(later[:, None, None, :], float("-inf"))
        # the best `earlier` gates, the earlier block first among equals: topk over
        # gates made unique by a tie-break that costs no ordering of distinct ones
        values, picked = _top_blocks(gates, earlier)
        blocks = torch.cat([picked, blocks], dim=-1)  # (N, Hkv, G, earlier + 1)
        chosen = torch.cat([values > float("-inf"), chosen], dim=-1)
    offsets = torch.arange(moba_block_size, device=device)
    keys_at = blocks[..., None] * moba_block_size + offsets  # (N, Hkv, G, K, B)
    visible = chosen[..., None] & (keys_at <= positions[:, None, None, None, None])
    # a hidden key reads the query's own position: written, unlike a block past it
    keys_at = torch.where(visible, keys_at, positions[:, None, None, None, None])
    slots = _positions_to_slots(block_table, keys_at, block_size)
    kv_head = torch.arange(kv_heads, device=device)[None, :, None, None, None].expand_as(slots)
    width = slots.shape[-2] * slots.shape[-1]
    slots, kv_head = slots.reshape(n, kv_heads, group, width), kv_head.reshape(n, kv_heads,
                                                                              group, width)
    keys = _gather_rows(kv_cache, KEY, kv_head, slots, dtype)  # (N, Hkv, G, width, D)
    values = _gather_rows(kv_cache, VALUE, kv_head, slots, dtype)
    scores = torch.einsum("nkgd,nkgwd->nkgw", q, keys) * scale
    scores.masked_fill_(~visible.reshape(n, kv_heads, group, width), float("-inf"))
    out = torch.einsum("nkgw,nkgwd->nkgd", scores.softmax(-1), values)
    return out.reshape(n, kv_heads * group, head_dim)


def _chunk(query: torch.Tensor, kv_cache: torch.Tensor, means: torch.Tensor,
           metadata: AttentionMetadata, i: int, first: int, scale: float,
           moba_block_size: int, topk: int) -> torch.Tensor:
    """MoBA rows of request ``i``'s chunk: ``query`` (Q, H, D) at positions ``first`` ..
    ``first + Q - 1``, all at the minimum; (Q, H, D). Its context's K/V read once; each
    key block then multiplies the rows that chose it (or whose own block it is) at once."""
    q_len, heads, head_dim = query.shape
    kv_heads, block = kv_cache.shape[1], moba_block_size
    group, device, dtype = heads // kv_heads, query.device, query.dtype
    last = first + q_len  # keys [0, last)
    slots = _positions_to_slots(metadata.block_table[i:i + 1],
                                torch.arange(last, device=device)[None], metadata.block_size)
    heads_at = torch.arange(kv_heads, device=device)[:, None]
    keys = _gather_rows(kv_cache, KEY, heads_at, slots.expand(kv_heads, -1), dtype)  # (Hkv, S, D)
    values = _gather_rows(kv_cache, VALUE, heads_at, slots.expand(kv_heads, -1), dtype)
    num_blocks = (last - 1) // block  # earlier blocks, at most
    per = block // metadata.block_size
    mean_at = metadata.block_table[i, per - 1::per][:num_blocks].long()
    block_means = means[:, mean_at]  # (Hkv, num_blocks, D)
    earlier = min(topk - 1, num_blocks)
    width = (earlier + 1) * block
    output = torch.empty_like(query)
    tile = max(1, _GATHER_BYTES // (heads * width * 8))  # queries whose scores fit
    for lo in range(0, q_len, tile):
        hi = min(q_len, lo + tile)
        n, rows = hi - lo, (hi - lo) * group
        # (Hkv, rows, D): row t * G + g is query lo + t of query head (kv head, g)
        q = query[lo:hi].float().view(n, kv_heads, group, head_dim).permute(1, 0, 2, 3)
        q = q.reshape(kv_heads, rows, head_dim)
        pos = torch.arange(first + lo, first + hi, device=device).repeat_interleave(group)
        own = pos // block
        # slot `earlier` holds each row's own block, slots 0 .. earlier - 1 its chosen ones
        scores = torch.full((kv_heads, rows, earlier + 1, block), float("-inf"), device=device)
        own_blocks = range((first + lo) // block, (first + hi - 1) // block + 1)
        spans = []  # (own block, first row, end row, keys)
        for c in own_blocks:
            r0 = max(0, c * block - first - lo) * group
            r1 = min(n, (c + 1) * block - first - lo) * group
            count = min(block, last - c * block)
            spans.append((c, r0, r1, count))
            s = torch.matmul(q[:, r0:r1], keys[:, c * block:c * block + count].transpose(1, 2))
            hidden = c * block + torch.arange(count, device=device) > pos[r0:r1, None]
            scores[:, r0:r1, earlier, :count] = s.masked_fill_(hidden, float("-inf")) * scale
        picks = []  # (kv head, block, rows, slots)
        if earlier > 0:
            gates = torch.matmul(q, block_means.transpose(1, 2))  # (Hkv, rows, num_blocks)
            later = torch.arange(num_blocks, device=device) >= own[:, None]
            gates.masked_fill_(later, float("-inf"))
            gate_values, picked = _top_blocks(gates, earlier)  # (Hkv, rows, earlier)
            chosen = gate_values > float("-inf")
            for h in range(kv_heads):
                for m in torch.unique(picked[h][chosen[h]]).tolist():
                    r, t = torch.nonzero((picked[h] == m) & chosen[h], as_tuple=True)
                    picks.append((h, m, r, t))
                    scores[h, r, t] = torch.matmul(
                        q[h, r], keys[h, m * block:(m + 1) * block].T) * scale
        probs = scores.view(kv_heads, rows, width).softmax(-1).view_as(scores)
        out = torch.zeros(kv_heads, rows, head_dim, device=device)
        for c, r0, r1, count in spans:
            out[:, r0:r1] += torch.matmul(probs[:, r0:r1, earlier, :count],
                                          values[:, c * block:c * block + count])
        for h, m, r, t in picks:
            out[h].index_add_(0, r, torch.matmul(probs[h, r, t],
                                                 values[h, m * block:(m + 1) * block]))
        output[lo:hi] = out.view(kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(
            n, heads, head_dim).to(dtype)
    return output


def _top_blocks(gates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``gates`` (..., M) and their indices, ties to the lower index."""
    # stable descending sort: equal gates keep their (ascending) block order
    values, order = gates.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]


def _dense(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
           i: int, first: int, scale: float) -> torch.Tensor:
    """Full causal attention of request ``i``'s queries (Q, H, D) at positions
    ``first`` .. ``first + Q - 1`` over its keys up to there; (Q, H, D)."""
    q_len, heads, head_dim = query.shape
    kv_heads = kv_cache.shape[1]
    device = query.device
    positions = torch.arange(first + q_len, device=device)[None]  # (1, S)
    slots = _positions_to_slots(metadata.block_table[i:i + 1], positions, metadata.block_size)
    heads_at = torch.arange(kv_heads, device=device)[:, None]
    slots = slots.expand(kv_heads, -1)
    keys = _gather_rows(kv_cache, KEY, heads_at, slots, query.dtype)  # (Hkv, S, D)
    values = _gather_rows(kv_cache, VALUE, heads_at, slots, query.dtype)
    q = query.float().view(q_len, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("qkgd,ksd->qkgs", q, keys) * scale
    hidden = positions > (first + torch.arange(q_len, device=device))[:, None]  # (Q, S)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out = torch.einsum("qkgs,ksd->qkgd", scores.softmax(-1), values)
    return out.reshape(q_len, heads, head_dim).to(query.dtype)
