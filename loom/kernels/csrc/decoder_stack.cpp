// A Llama-style model's decoder layers over one step, in C++ so that the ~25 small
// tensor ops per layer cost no Python (about 1.1 ms of an 8.9 ms batch-1 step). The same
// kernels, on the same tensors, in the same order as the modules' forward on the CPU
// (LlamaDecoderLayer with the `cpu` attention backend), so the results are identical.

#include "bf16_gemm.h"
#include "common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <limits>
#include <vector>

namespace loom {

// Per layer `weights` holds 12 tensors: input norm weight, qkv packed, qkv bias, o
// packed, o bias, post-attention norm weight, gate_up packed, gate_up bias, down
// packed, down bias, q norm weight, k norm weight (an empty tensor for no bias / no
// per-head q/k norm, as Qwen3 has); every matmul is loom's bf16_linear.
// Returns (hidden, residual) after the last layer, for the final norm.
std::vector<at::Tensor> decoder_layers(
    at::Tensor hidden, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& kv_caches, at::Tensor positions,
    at::Tensor cos_sin_cache, at::Tensor slot_mapping, at::Tensor block_table,
    at::Tensor seq_lens, at::Tensor query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale,
    double eps) {
  constexpr size_t kPerLayer = 12;
  const size_t layers = kv_caches.size();
  TORCH_CHECK(weights.size() == layers * kPerLayer, "decoder_layers: ", kPerLayer,
              " weights per layer expected");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be (T, H), contiguous");
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto bias = [](const at::Tensor& b) {
    return b.numel() ? c10::optional<at::Tensor>(b) : c10::optional<at::Tensor>();
  };
  auto linear = [&](const at::Tensor& x, const at::Tensor& packed, const at::Tensor& b,
                    int64_t out_features) {
    auto out = at::empty({tokens, out_features}, x.options());
    bf16_linear(out, x, packed, bias(b));
    return out;
  };
  at::Tensor residual = hidden;
  at::Tensor x;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    if (l == 0)
      x = rms_norm(hidden, w[0], eps);
    else
      fused_add_rms_norm(x, residual, w[0], eps);
    auto qkv = linear(x, w[1], w[2], q_size + 2 * kv_size);
    at::Tensor q, k;
    if (w[10].numel()) {  // per-head RMSNorm on q and k (new tensors), then rope on each
      q = rms_norm(qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), w[10], eps);
      k = rms_norm(qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim}), w[11],
                   eps);
      rotary_embedding(q, positions, cos_sin_cache);
      rotary_embedding(k, positions, cos_sin_cache);
    } else {  // q and k adjacent in qkv: rope on both in one pass, in place
      auto qk = qkv.narrow(1, 0, q_size + kv_size)
                    .view({tokens, num_heads + num_kv_heads, head_dim});
      rotary_embedding(qk, positions, cos_sin_cache);
      q = qk.narrow(1, 0, num_heads);
      k = qk.narrow(1, num_heads, num_kv_heads);
    }
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    write_kv_cache(k, v, kv_caches[l], slot_mapping);
    auto attn = at::empty({tokens, num_heads, head_dim}, x.options());
    paged_attention(attn, q, kv_caches[l], block_table, seq_lens, query_start_loc, scale,
                    std::numeric_limits<int64_t>::max());
    auto o = linear(attn.view({tokens, q_size}), w[3], w[4], width);
    fused_add_rms_norm(o, residual, w[5], eps);
    auto act = silu_and_mul(linear(o, w[6], w[7], 2 * intermediate_size));
    x = linear(act, w[8], w[9], width);
  }
  return {x, residual};
}

}  // namespace loom
