// loom's CPU kernels, one family per file as in vLLM's csrc/cpu/: what
// torch_bindings.cpp registers and experts.cpp calls. Each is documented where
// it is defined; the bf16 matmul is declared in bf16_gemm.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

// layernorm.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight,
                  double eps);

// activation.cpp
at::Tensor silu_and_mul(at::Tensor x);

// pos_encoding.cpp
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos_sin_cache);

// cache.cpp
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping);

// segment_attention.cpp
bool segment_attention_available();
void segment_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v,
                       at::Tensor lengths, double scale);

// attention.cpp
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc,
                     double scale, int64_t max_query_len);
void paged_attention_windowed(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                              at::Tensor block_table, at::Tensor seq_lens,
                              at::Tensor query_start_loc, double scale, int64_t max_query_len,
                              int64_t sliding_window);

// moba.cpp: MoBA over the paged cache (loom/model/attention/moba.py); means (Hkv,
// num_blocks, D) float32, each MoBA block's mean key at the cache block of its last key
void moba_update_block_means(at::Tensor means, at::Tensor kv_cache, at::Tensor block_table,
                             at::Tensor seq_lens, at::Tensor query_start_loc,
                             int64_t moba_block_size);
void moba_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor means,
                    at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc,
                    double scale, int64_t moba_block_size, int64_t topk, int64_t min_seq_len);

// sampling.cpp: logits (R, V) float32 -> (R,) int64, each row's torch.argmax
at::Tensor argmax_rows(at::Tensor logits);

// moe.cpp: a mixture of experts' router over bf16 hidden states
struct MoERouting {
  int64_t top_k;
  bool sigmoid;  // sigmoid scores, else softmax
  bool renormalize;
  double renormalize_min;
};
// Tokens [begin, end) of x (rows ldx apart, `width` features) routed over `router`
// (num_experts, width) float32, `bias` (num_experts,) float32 or null: their top_k weights
// (float32) and expert ids, rows of top_k.
void moe_route_rows(const c10::BFloat16* x, int64_t ldx, int64_t begin, int64_t end,
                    int64_t width, const float* router, int64_t num_experts, const float* bias,
                    const MoERouting& routing, float* weights, int64_t* ids);
// x (T, H) bf16, router (E, H) float32 or bf16 -> [weights (T, K) float32, ids (T, K) int64]
std::vector<at::Tensor> moe_route(at::Tensor x, at::Tensor router,
                                  c10::optional<at::Tensor> correction_bias, int64_t top_k,
                                  const std::string& scoring, bool renormalize,
                                  double renormalize_min);

// lora.cpp: y (T, N) += each row's LoRA adapter: (x_t a[s]^T) b[s] for s = token_slot[t]
// >= 0 and active[s]; a (S, R, K), b (S, R, N); part_sizes: a fused layer's outputs, part
// p reading rank rows [p R/P, (p+1) R/P) of b only (empty: one part) (layers/lora.py)
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& token_slot, const at::Tensor& active,
              const std::vector<int64_t>& part_sizes);
// lora.cpp: y (T, D) += each row's embedding LoRA: a_t[s][ids[t]] b[s] for s = token_slot[t]
// >= 0 and active[s]; a_t (S, V, R), b (S, R, D) (layers/lora.py)
void lora_embedding_add(at::Tensor y, const at::Tensor& ids, const at::Tensor& a_t,
                        const at::Tensor& b, const at::Tensor& token_slot,
                        const at::Tensor& active);

}  // namespace loom
