"""A hand-rolled paged KV cache driver for model tests: the few things the model
runner does (allocate blocks, build slot mappings and block tables) with plain lists."""

from __future__ import annotations

import random

import torch

from loom.model.attention.kv_layout import is_quantized_kv
from loom.model.attention.metadata import AttentionMetadata, set_forward_context


class PagedDriver:
    def __init__(self, model, num_blocks: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        """``dtype``: the cache's (the model's, or torch.int8 / an fp8 dtype for a
        quantized one)."""
        self.model = model
        self.block_size = block_size
        shape = model.kv_cache_shape(num_blocks, block_size, quantized=is_quantized_kv(dtype))
        model.bind_kv_cache([torch.zeros(shape, dtype=dtype)
                             for _ in range(model.num_attention_layers)])
        # Hand out blocks in a shuffled order so a request's blocks are not contiguous.
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Run one forward. ``work``: ``(request_id, all token ids so far, num_new)``;
        the new tokens are the last ``num_new`` of ``all token ids``. Returns the
        logits of every new token, (T, vocab), in ``work`` order."""
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for req_id, tokens, num_new in work:
            start = self.num_computed.get(req_id, 0)
            assert start + num_new == len(tokens), "the driver runs contexts in order"
            table = self.block_tables.setdefault(req_id, [])
            while len(table) * self.block_size < len(tokens):
                table.append(self.free_blocks.pop())
            for pos in range(start, len(tokens)):
                input_ids.append(tokens[pos])
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(len(tokens))
            self.num_computed[req_id] = len(tokens)
        max_blocks = max(len(self.block_tables[r]) for r, _, _ in work)
        block_table = [self.block_tables[r] + [0] * (max_blocks - len(self.block_tables[r]))
                       for r, _, _ in work]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(block_table, dtype=torch.int32),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max(n for _, _, n in work),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)
