"""Attention backend on loom's Triton kernels (``triton_attention.py``), for CUDA.

New K/V go to their slots as in the torch reference (``_write_kv``: one ``index_copy_``
each, quantized first for an int8 / fp8 cache); then one kernel launch (two for a split
decode) runs attention for every request of the step, reading each context where it lies
in the block pool, quantized rows dequantized in the kernel. The profiling run before the
cache exists and a step with bidirectional spans (an image whose tokens see each other,
which the kernel's causal mask does not open) run the torch backend's code.

Opt-in (``--attention-backend triton``): proven equal to the torch reference only under
Triton's interpreter on the CPU, not yet on a GPU, so ``auto`` does not choose it.
"""

from __future__ import annotations

from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.torch_backend import TorchAttentionBackend
from loom.model.attention.triton_attention import paged_attention


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        if kv_cache is None or metadata.bidirectional_spans:
            return super().forward(query, key, value, kv_cache, metadata)
        self._write_kv(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                               metadata.query_start_loc, self.scale, metadata.max_query_len,
                               metadata.max_seq_len, self.sliding_window)
