// loom's CPU kernels, one family per file as in vLLM's csrc/cpu/: what
// torch_bindings.cpp registers and decoder_stack.cpp calls. Each is documented where
// it is defined; the bf16 matmul is declared in bf16_gemm.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom {

// layernorm.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);

// activation.cpp
at::Tensor silu_and_mul(at::Tensor x);

// pos_encoding.cpp
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos_sin_cache);

// cache.cpp
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping);

// attention.cpp
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc,
                     double scale, int64_t max_query_len);
void paged_attention_windowed(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                              at::Tensor block_table, at::Tensor seq_lens,
                              at::Tensor query_start_loc, double scale, int64_t max_query_len,
                              int64_t sliding_window);

}  // namespace loom
