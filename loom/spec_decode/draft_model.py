"""DraftModelProposer: a smaller model with the target's tokenizer drafts k tokens greedily.

It lives in rank 0's worker with its own paged KV cache of the same geometry as the
target's (same block ids, same slots), so the scheduler's block tables serve both:

    every step   catch_up: the draft model runs the target's exact flat input (prompt
                 chunks, last tokens and drafts alike), writing its K/V into the same
                 slots. Rejected drafts leave stale K/V that the next step overwrites,
                 as for the target.
    then         propose: from each sampling request's newest token, k single-token
                 forwards, each taking the argmax, writing K/V for the drafts into the
                 lookahead slots the scheduler booked (``num_lookahead_tokens``).

Drafts are deterministic (greedy), so the rejection sampler treats the draft
distribution as one-hot, which keeps sampling exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from loom.config import EngineConfig
from loom.distributed.parallel_state import SINGLE
from loom.model.attention.metadata import AttentionMetadata, set_forward_context
from loom.model.layers.sampler import greedy_argmax
from loom.model.loader import kv_cache_bytes_per_block, load_model, model_hf_config


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = config.speculative
        self.path = spec.model
        self.k = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.device = device
        self.dtype = dtype
        self.attention_backend = config.model.attention_backend
        self.hf_config = model_hf_config(spec)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self) -> None:
        # Unsharded, on this rank only: a draft model is small.
        self.model = load_model(self.path, self.hf_config, dtype=self.dtype, device=self.device,
                                tp_group=SINGLE, attention_backend=self.attention_backend,
                                max_model_len=self.max_model_len)

    @property
    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype, 1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.model.num_attention_layers)]
        self.model.bind_kv_cache(self.kv_caches)

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """Write the draft model's K/V for the tokens the target just computed."""
        # A fresh copy: backends cache per-step values that depend on the model's shape.
        with set_forward_context(dataclasses.replace(metadata)):
            self.model(input_ids, positions)

    def propose(self, last_token_ids: list[int], positions: list[int],
                block_tables: list[list[int]], vocab_size: int) -> list[list[int]]:
        """Up to k greedy drafts per request, continuing from ``last_token_ids[i]`` at
        ``positions[i]``. A request stops drafting where its booked slots (or
        max_model_len) end."""
        num_reqs = len(last_token_ids)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        tokens = list(last_token_ids)
        pos = list(positions)
        limits = [min(len(blocks) * self.block_size, self.max_model_len) for blocks in block_tables]
        active = list(range(num_reqs))
        for _ in range(self.k):
            active = [i for i in active if pos[i] < limits[i]]
            if not active:
                break
            metadata = self._decode_metadata([pos[i] for i in active],
                                             [block_tables[i] for i in active])
            input_ids = torch.tensor([tokens[i] for i in active], dtype=torch.int64,
                                     device=self.device)
            step_positions = torch.tensor([pos[i] for i in active], dtype=torch.int64,
                                          device=self.device)
            with set_forward_context(metadata):
                hidden_states = self.model(input_ids, step_positions)
            logits = self.model.compute_logits(hidden_states)[:, :vocab_size]
            for i, token_id in zip(active, greedy_argmax(logits).tolist()):
                drafts[i].append(token_id)
                tokens[i] = token_id
                pos[i] += 1
        return drafts

    def _decode_metadata(self, positions: list[int],
                         block_tables: list[list[int]]) -> AttentionMetadata:
        """One new token per request, at ``positions[i]``."""
        num_reqs = len(positions)
        pos = np.asarray(positions, dtype=np.int64)
        block_table = np.zeros((num_reqs, max(len(b) for b in block_tables)), np.int64)
        for i, blocks in enumerate(block_tables):
            block_table[i, :len(blocks)] = blocks
        slot_mapping = (block_table[np.arange(num_reqs), pos // self.block_size]
                        * self.block_size + pos % self.block_size)
        seq_lens = pos + 1
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int64)
        return AttentionMetadata.from_numpy(slot_mapping, query_start_loc, seq_lens,
                                            block_table, self.block_size, self.device)
