"""Reference attention backend in plain PyTorch; runs on CPU and CUDA.

Decode requests (one new token) are batched: one gather of their context from the
paged cache and one SDPA with a length mask. Requests with several new tokens
(prefill, chunked prefill) run one SDPA each with a causal mask offset by the
number of tokens already in the cache.

GQA without copying K/V: the G = H / Hkv query heads that share a KV head are laid
out as G "query rows" of that KV head, ``(…, H, D) -> (…, Hkv, G, D)``, which is how
Hugging Face's ``repeat_kv`` pairs them (query head h reads KV head h // G).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.model.attention.backend import AttentionBackend
from loom.model.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        if kv_cache is not None:
            self._write_kv(key, value, kv_cache, metadata.slot_mapping)
        if kv_cache is not None and metadata.is_pure_decode:
            return self._decode(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                metadata.max_seq_len, metadata.block_size)
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu

        decode_reqs: list[int] = []
        for i in range(metadata.num_reqs):
            start, end = starts[i], starts[i + 1]
            if end - start == 1 and kv_cache is not None:
                decode_reqs.append(i)
                continue
            if kv_cache is None:
                k, v = key[start:end], value[start:end]
            else:
                k, v = self._gather_one(kv_cache, metadata.block_table[i], seq_lens[i],
                                        metadata.block_size)
            output[start:end] = self._prefill(query[start:end], k, v)
        if decode_reqs:
            req_index = torch.tensor(decode_reqs, device=query.device)
            token_index = torch.tensor([starts[i] for i in decode_reqs], device=query.device)
            max_len = max(seq_lens[i] for i in decode_reqs)
            output[token_index] = self._decode(
                query[token_index], kv_cache, metadata.block_table[req_index],
                metadata.seq_lens[req_index], max_len, metadata.block_size)
        return output

    @staticmethod
    def _write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    @staticmethod
    def _gather_one(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks = -(-seq_len // block_size)
        kv = kv_cache[:, block_ids[:num_blocks].long()]  # (2, nb, bs, Hkv, D)
        kv = kv.flatten(1, 2)[:, :seq_len]  # (2, S, Hkv, D)
        return kv[0], kv[1]

    def _prefill(self, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> torch.Tensor:
        """``query`` (Q, H, D) are the last Q positions of a context of S = len(key)."""
        q_len, seq_len = query.shape[0], key.shape[0]
        group = self.num_heads // self.num_kv_heads
        # (Q, Hkv*G, D) -> (Hkv, G*Q, D): row g*Q + j is query j of head (kv_head, g)
        q = query.view(q_len, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        q = q.reshape(self.num_kv_heads, group * q_len, self.head_dim)
        k, v = key.transpose(0, 1), value.transpose(0, 1)  # (Hkv, S, D)
        # query j sits at position S - Q + j and sees keys 0 .. S - Q + j
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]  # (Q, S)
        mask = mask.repeat(group, 1)  # (G*Q, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out.view(self.num_kv_heads, group, q_len, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(q_len, self.num_heads, self.head_dim)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
        """One new token per request: ``query`` (B, H, D) over contexts of ``seq_lens``."""
        batch = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        num_blocks = -(-max_seq_len // block_size)
        kv = kv_cache[:, block_table[:, :num_blocks].long()]  # (2, B, nb, bs, Hkv, D)
        kv = kv.flatten(2, 3)[:, :, :max_seq_len]  # (2, B, L, Hkv, D)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, Hkv, L, D)
        q = query.view(batch, self.num_kv_heads, group, self.head_dim)  # (B, Hkv, G, D)
        positions = torch.arange(max_seq_len, device=query.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # (B, 1, 1, L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, self.head_dim)
