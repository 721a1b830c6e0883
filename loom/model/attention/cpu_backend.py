"""CPU attention backend on loom's native kernels (``loom.kernels``).

Same cache layout (``kv_layout.py``, which the kernels index) and results as the torch
backend, without its gathers: new K/V go to their slots in one call, and one call runs
attention for every request (decodes, speculative verification, prefill chunks),
reading each context where it lies in the block pool (a sliding-window layer's keys
outside its window masked). In float32, prefill chunks longer than
``MAX_NATIVE_QUERY_LEN`` run one SDPA each, as in the torch backend, whose
matmuls win there. Without the kernels (no compiler, ``LOOM_NATIVE_KERNELS=0``), on CUDA, in
float16, in the profiling run before the cache exists, and for a step with bidirectional
spans (an image whose tokens see each other, which the kernels' causal masks do not
open), it is the torch backend.
"""

from __future__ import annotations

import torch

from loom.kernels import native_ops_for
from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.torch_backend import TorchAttentionBackend

# Longest query (new tokens of one request) the native kernel takes in float32; the
# bf16 kernel (AVX512-BF16) beats SDPA at every length measured, up to 256 new
# tokens over a 1,000-token context (benchmarks/cpu_kernels.py).
MAX_NATIVE_QUERY_LEN = {torch.float32: 256, torch.bfloat16: 1 << 30}


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        ops = native_ops_for(query.device, query.dtype)
        if kv_cache is None or ops is None or metadata.bidirectional_spans:
            return super().forward(query, key, value, kv_cache, metadata)
        ops.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        max_query_len = MAX_NATIVE_QUERY_LEN.get(query.dtype, 0)
        if self.sliding_window is None:
            ops.paged_attention(output, query, kv_cache, metadata.block_table,
                                metadata.seq_lens, metadata.query_start_loc, self.scale,
                                max_query_len)
        else:
            ops.paged_attention_windowed(output, query, kv_cache, metadata.block_table,
                                         metadata.seq_lens, metadata.query_start_loc,
                                         self.scale, max_query_len, self.sliding_window)
        if metadata.max_query_len > max_query_len:
            starts = metadata.query_start_loc_cpu
            for i in range(metadata.num_reqs):
                if starts[i + 1] - starts[i] > max_query_len:
                    self._prefill_request(i, query, key, value, kv_cache, metadata, output)
        return output
