"""Per-step attention metadata, installed for one forward by a context manager.

The model runner flattens a step's scheduled tokens into one sequence of T tokens,
requests contiguous and in batch order. For request i its new tokens are
``query_start_loc[i] : query_start_loc[i + 1]``; they sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` of that request's context.

    request 0: | computed (cached K/V) | new (3) |      query_start_loc = [0, 3, 4]
    request 1: | computed ............................ | new (1) |

Each new token's K/V is written to slot ``block_id * block_size + offset``
(``slot_mapping``) of the layer's KV cache; attention then reads
the whole context of request i through ``block_table[i]``. A hybrid KV cache
(kv_cache_groups.py) has one block table per group: group 0's are these fields, and
``group_metadata[g - 1]`` is the same step through group g's tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 flat slot for each new token's K/V
    query_start_loc: torch.Tensor  # (B + 1,) int32 cumulative query lengths
    seq_lens: torch.Tensor  # (B,) int32 context length after this step
    block_table: torch.Tensor  # (B, max_blocks_per_seq) int32, padded with 0
    # The same numbers as Python lists, so backends can loop without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # KV cache groups 1.. (a hybrid model): this step with each group's slots and tables
    group_metadata: list[AttentionMetadata] = field(default_factory=list)
    # LoRA adapters (model/layers/lora.py): each token's adapter slot, -1 for the base;
    # None where LoRA is off. Not attention's, but the step's, as everything here.
    lora_slots: torch.Tensor | None = None
    # Step token ranges [start, end) whose queries see all of the range's keys, not only
    # the earlier ones: an image of a family whose image tokens attend to each other
    # both ways (MultiModalFeature.bidirectional). Each lies within one request's new
    # tokens; a sliding window still hides keys too far behind a query.
    bidirectional_spans: tuple[tuple[int, int], ...] = ()
    # (T,) int64: each token's sequence length as a rope whose frequencies depend on it
    # sees it (layers/rotary.py, LengthScaledRotaryEmbedding): max(its request's prompt
    # length, its position + 1). None where the model has no such rope or no token of the
    # step is past its original context; a step with them runs eagerly.
    rope_lengths: torch.Tensor | None = None
    # Every request has exactly this many new tokens (a speculative verification step:
    # its last token and its drafts) and attention batches them over the cache as it
    # batches decode tokens, reading lengths from ``seq_lens`` on the device, never the
    # ``*_cpu`` lists (which a captured step fills with its buckets). Set by a CUDA
    # graph's step (worker/cuda_graphs.py); None elsewhere.
    query_len: int | None = None
    # Per-step values derived by the attention backend (gather indices, masks), built
    # by the first layer that needs them and reused by the others; see ``cached``.
    _derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False,
                                     compare=False)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per step (per ``key``); later calls return the same value."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = build()
        return value

    @classmethod
    def from_numpy(cls, slot_mapping: np.ndarray, query_start_loc: np.ndarray,
                   seq_lens: np.ndarray, block_table: np.ndarray, block_size: int,
                   device: torch.device) -> AttentionMetadata:
        """Build a step's metadata from the runner's int64 numpy arrays."""
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        return cls(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_table=torch.from_numpy(block_table.astype(np.int32)).to(device),
            query_start_loc_cpu=starts, seq_lens_cpu=lens,
            # maxima of the lists: numpy's diff and two reductions cost ~10 us a step,
            # Python's max over a batch's values 1-3
            max_query_len=max(map(operator.sub, starts[1:], starts)), max_seq_len=max(lens),
            block_size=block_size)

    def with_blocks(self, slot_mapping: np.ndarray, block_table: np.ndarray,
                    device: torch.device) -> AttentionMetadata:
        """This step through another KV cache group's slots and block tables."""
        return dataclasses.replace(
            self, slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_table=torch.from_numpy(block_table.astype(np.int32)).to(device),
            group_metadata=[])

    def for_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.group_metadata[group - 1]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata | None) -> Iterator[None]:
    """Install ``metadata`` for the forward that runs inside the ``with`` block."""
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(); the model "
                           "runner must install AttentionMetadata for each forward")
    return _current
