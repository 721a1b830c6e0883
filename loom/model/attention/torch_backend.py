"""Reference attention backend in plain PyTorch; runs on CPU and CUDA.

Decode requests (one new token) are batched: one gather of their contexts from the
paged cache and two matmuls with a length mask. Requests with several new tokens
(prefill, chunked prefill) run one SDPA each with a causal mask offset by the
number of tokens already in the cache, opened within the request's bidirectional spans
(``AttentionMetadata.bidirectional_spans``: an image whose tokens see each other). Gather
indices and masks are built once per step (``AttentionMetadata.cached``) and shared by
all layers.

GQA without copying K/V: the G = H / Hkv query heads that share a KV head are laid
out as G "query rows" of that KV head, ``(…, H, D) -> (…, Hkv, G, D)``, which is how
Hugging Face's ``repeat_kv`` pairs them (query head h reads KV head h // G).

A cache in another dtype than the model's (``--kv-cache-dtype``: bfloat16 under a float32
model, or int8 / fp8) is written converted (quantized: ``quantize_kv_rows``, kv_layout.py's
rows) and read back in the model's dtype; then every query reads K/V as the cache holds
them, a prompt's own tokens included, as the native kernels do.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from loom.model.attention.backend import AttentionBackend
from loom.model.attention.kv_layout import (KEY, KV_SCALE_BYTES, VALUE, is_quantized_kv,
                                           kv_row_qmax, slot_rows)
from loom.model.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        if kv_cache is not None:
            self._write_kv(key, value, kv_cache, metadata.slot_mapping)
            if metadata.is_pure_decode or metadata.query_len:
                query_len = metadata.query_len or 1
                slots, mask = metadata.cached(
                    ("decode", query.dtype, self.sliding_window),
                    lambda: _decode_plan(metadata, None, query.dtype, self.sliding_window,
                                         query_len))
                return self._decode(query, kv_cache, slots, mask, query_len)
        output = torch.empty_like(query)
        plan = metadata.cached(("plan", kv_cache is None),
                               lambda: _StepPlan.build(metadata, kv_cache is None))
        starts = metadata.query_start_loc_cpu
        for i in plan.single:
            self._prefill_request(i, query, key, value, kv_cache, metadata, output)
        if plan.decode:
            slots, mask = metadata.cached(("decode_subset", query.dtype, self.sliding_window),
                                          lambda: _decode_plan(metadata, plan.decode,
                                                               query.dtype,
                                                               self.sliding_window))
            token_index = metadata.cached(("decode_tokens",), lambda: torch.tensor(
                [starts[i] for i in plan.decode], device=query.device))
            output[token_index] = self._decode(query[token_index], kv_cache, slots, mask)
        return output

    def _prefill_request(self, i: int, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, kv_cache: torch.Tensor | None,
                         metadata: AttentionMetadata, output: torch.Tensor) -> None:
        """Request ``i``'s new tokens by one SDPA over its context, into ``output``."""
        start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
        fresh = metadata.seq_lens_cpu[i] == end - start
        if kv_cache is None or (fresh and kv_cache.dtype == query.dtype):
            # nothing cached before these tokens: attend to them directly
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        else:
            slots = metadata.cached(("context", i, self.sliding_window),
                                    partial(_context_slots, metadata, i, end - start,
                                            self.sliding_window))
            k, v = self._gather(kv_cache, slots, query.dtype)
        # its spans whose queries see all their keys, as query indices [first, last)
        spans = tuple((first - start, last - start)
                      for first, last in metadata.bidirectional_spans if start <= first < end)
        mask = metadata.cached(("prefill_mask", end - start, k.shape[1], query.dtype,
                                self.sliding_window, spans),
                               partial(_prefill_mask, end - start, k.shape[1], self.group,
                                       query.dtype, query.device, self.sliding_window, spans))
        output[start:end] = self._prefill(query[start:end], k, v, mask)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def _write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        rows = slot_rows(kv_cache)  # (2, Hkv, num_slots, row)
        if is_quantized_kv(kv_cache.dtype):
            # as bytes: index_copy_ has no fp8 kernel
            rows = rows.view(torch.int8)
            key = quantize_kv_rows(key, kv_cache.dtype).view(torch.int8)
            value = quantize_kv_rows(value, kv_cache.dtype).view(torch.int8)
        # (Hkv, num_slots, row) <- (Hkv, T, row)
        rows[KEY].index_copy_(1, slot_mapping, key.transpose(0, 1).to(rows.dtype))
        rows[VALUE].index_copy_(1, slot_mapping, value.transpose(0, 1).to(rows.dtype))

    @staticmethod
    def _gather(kv_cache: torch.Tensor, slots: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of ``slots`` (N,), each (Hkv, N, D) in ``dtype``, contiguous."""
        rows = slot_rows(kv_cache)  # (2, Hkv, num_slots, row)
        kv = rows.flatten(0, 1).index_select(1, slots).view(*rows.shape[:2], -1, rows.shape[3])
        if is_quantized_kv(kv_cache.dtype):
            kv = dequantize_kv_rows(kv, dtype)
        elif kv_cache.dtype != dtype:
            kv = kv.to(dtype)
        return kv[KEY], kv[VALUE]

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """``query`` (Q, H, D) are the last Q positions of a context of S tokens whose
        ``key``/``value`` are (Hkv, S, D); ``mask`` (G*Q, S) additive."""
        q_len = query.shape[0]
        # (Q, Hkv*G, D) -> (Hkv, G*Q, D): row g*Q + j is query j of head (kv_head, g)
        q = query.view(q_len, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        q = q.reshape(self.num_kv_heads, self.group * q_len, self.head_dim)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=self.scale)
        out = out.view(self.num_kv_heads, self.group, q_len, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(q_len, self.num_heads, self.head_dim)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor, query_len: int = 1) -> torch.Tensor:
        """``query_len`` Q new tokens per request (1: decode; Q: a verification step's
        last token and drafts): ``query`` (B*Q, H, D) over the contexts whose ``slots``
        are (B*L,) and ``mask`` (1, B, Q, L) additive.

        Two batched matmuls, not SDPA: at one query row per head, CPU SDPA kernels
        are several times slower. Softmax in float32, as Hugging Face's eager path."""
        batch = query.shape[0] // query_len
        key, value = self._gather(kv_cache, slots, query.dtype)  # (Hkv, B*L, D) each
        key = key.view(self.num_kv_heads, batch, -1, self.head_dim)  # (Hkv, B, L, D)
        value = value.view(self.num_kv_heads, batch, -1, self.head_dim)
        # (B*Q, Hkv*G, D) -> (Hkv, B, Q*G, D): row j*G + g is token j's head (kv_head, g)
        q = query.view(batch, query_len, self.num_kv_heads, self.group, self.head_dim)
        q = q.permute(2, 0, 1, 3, 4).reshape(self.num_kv_heads, batch, -1, self.head_dim)
        scores = torch.matmul(q, key.transpose(-1, -2))  # (Hkv, B, Q*G, L)
        scores = scores.view(self.num_kv_heads, batch, query_len, self.group, -1)
        probs = torch.add(mask[..., None, :], scores, alpha=self.scale).softmax(
            -1, dtype=torch.float32)  # (Hkv, B, Q, G, L)
        probs = probs.view(self.num_kv_heads, batch, query_len * self.group, -1)
        out = torch.matmul(probs.to(query.dtype), value)  # (Hkv, B, Q*G, D)
        out = out.view(self.num_kv_heads, batch * query_len, self.group, self.head_dim)
        return out.transpose(0, 1).reshape(batch * query_len, self.num_heads, self.head_dim)


def quantize_kv_rows(x: torch.Tensor, cache_dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """(..., D) K or V in the model's dtype -> (..., D + 4) cache rows in ``cache_dtype``
    (int8, float8_e4m3fn or float8_e5m2): each vector scaled by its own max |x| / QMAX,
    its float32 scale's bytes after it (kv_layout.py; the kernels' quantize_kv_row, bit
    for bit: torch's fp8 conversion rounds to nearest even, as c10's does there)."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / kv_row_qmax(cache_dtype)).clamp_min(
        torch.finfo(torch.float32).tiny)
    if cache_dtype == torch.int8:
        values = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    else:  # |x / scale| <= QMAX: no saturation needed
        values = (x / scale).to(cache_dtype).view(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1).view(cache_dtype)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., D + 4) quantized cache rows (int8 or fp8, their dtype) -> (..., D) in
    ``dtype``: float32 q * scale, rounded once."""
    values, scale = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:]
    scale = scale.contiguous().view(torch.int8).view(torch.float32)
    return (values.float() * scale).to(dtype)


class _StepPlan:
    """Which requests of a step decode (one new token, batched over the cache) and
    which run one by one (several new tokens, or no cache yet)."""

    def __init__(self, decode: list[int], single: list[int]) -> None:
        self.decode, self.single = decode, single

    @classmethod
    def build(cls, metadata: AttentionMetadata, no_cache: bool) -> _StepPlan:
        decode, single = [], []
        starts = metadata.query_start_loc_cpu
        for i in range(metadata.num_reqs):
            (decode if starts[i + 1] - starts[i] == 1 and not no_cache else single).append(i)
        return cls(decode, single)


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..length-1 of each row of ``block_table``:
    (R, length) int64. block_size 4, table [[7, 2]] -> [[28, 29, 30, 31, 8, 9, ...]]."""
    offsets = torch.arange(length, device=block_table.device)
    blocks = block_table[:, offsets // block_size].long()
    return blocks * block_size + offsets % block_size


def _decode_plan(metadata: AttentionMetadata, req_index: list[int] | None,
                 dtype: torch.dtype, sliding_window: int | None = None,
                 query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather slots (B*L,) and additive mask (1, B, Q, L) for the requests ``req_index``
    (all when None) of ``query_len`` Q new tokens each, L their longest context
    (``max_seq_len``: a captured step's context bucket). Query j of request i sits at
    position p = seq_lens[i] - Q + j and sees keys up to p. Positions no query of the
    request sees (past its context) are masked and read its last position again, so
    attention never reads a slot that was not written (the cache may hold NaN: 0 * NaN
    is NaN). With a ``sliding_window`` W, query j sees no key at or before p - W
    either; positions before ``seq_len - Q - W + 1``, which no query sees, read the
    last position as well (KVCacheManager may have freed their blocks)."""
    block_table, seq_lens = metadata.block_table, metadata.seq_lens
    if req_index is None:
        max_len = metadata.max_seq_len
    else:
        max_len = max(metadata.seq_lens_cpu[i] for i in req_index)
        index = torch.tensor(req_index, device=block_table.device)
        block_table, seq_lens = block_table[index], seq_lens[index]
    slots = _slots(block_table, max_len, metadata.block_size)  # (B, L)
    keys = torch.arange(max_len, device=block_table.device)[None, None, :]  # (1, 1, L)
    # (B, Q, 1): each query's position
    query_pos = (seq_lens[:, None] - query_len
                 + torch.arange(query_len, device=block_table.device))[:, :, None]
    hidden = keys > query_pos  # (B, Q, L)
    unread = keys[:, 0] >= seq_lens[:, None]  # (B, L): seen by no query
    if sliding_window is not None:
        hidden |= keys <= query_pos - sliding_window
        unread |= keys[:, 0] <= seq_lens[:, None] - query_len - sliding_window
    # Positions no query sees read the request's last key again: a block before the
    # window may be back in the pool.
    last = slots.gather(1, (seq_lens[:, None] - 1).clamp(min=0).long())
    slots = torch.where(unread, last, slots).flatten()
    mask = torch.zeros(hidden.shape, dtype=dtype, device=block_table.device)
    mask.masked_fill_(hidden, float("-inf"))
    return slots, mask[None]


def _context_slots(metadata: AttentionMetadata, i: int, q_len: int,
                   sliding_window: int | None = None) -> torch.Tensor:
    """Request ``i``'s context slots; with a ``sliding_window`` W, positions no query of
    the chunk sees (before ``seq_len - q_len - W + 1``) read the last position instead,
    since KVCacheManager may have freed their blocks (the mask hides them)."""
    seq_len = metadata.seq_lens_cpu[i]
    slots = _slots(metadata.block_table[i:i + 1], seq_len, metadata.block_size)[0]
    if sliding_window is not None:
        first_key = max(0, seq_len - q_len - sliding_window + 1)
        slots[:first_key] = slots[seq_len - 1]
    return slots


def _prefill_mask(q_len: int, seq_len: int, group: int, dtype: torch.dtype,
                  device: torch.device, sliding_window: int | None = None,
                  bidirectional: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """(G*Q, S) additive causal mask: query j sits at position S - Q + j and sees keys
    0 .. S - Q + j, and, where j lies in a span [first, last) of ``bidirectional``, the
    span's later keys too (Hugging Face's causal OR same image block); with a
    ``sliding_window`` W, only keys less than W behind the query, whichever rule shows
    them. Repeated for the G query rows of each KV head."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    key_pos = torch.arange(seq_len, device=device)[None, :]
    hidden = key_pos > query_pos[:, None]  # (Q, S)
    context = seq_len - q_len  # the key of query j is key context + j
    for first, last in bidirectional:
        hidden[first:last, context + first:context + last] = False
    if sliding_window is not None:
        hidden |= key_pos <= query_pos[:, None] - sliding_window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
    mask.masked_fill_(hidden, float("-inf"))
    return mask.repeat(group, 1)
