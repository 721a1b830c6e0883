// The native decoder stack (decoder_stack.h): a Llama-style model's decoder layers over
// one step in C++, so that the ~25 small tensor ops per layer cost no Python (about
// 1.1 ms of an 8.9 ms batch-1 step of SmolLM2). Each layer's weights arrive by name,
// filled from the model's declaration; this file is the one place that says what a
// layer does with them.

#include "decoder_stack.h"

#include "bf16_gemm.h"
#include "common.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <limits>
#include <utility>

namespace loom {

void LinearWeight::matmul(at::Tensor out, at::Tensor x,
                          const c10::optional<at::Tensor>& bias) const {
  if (quantized)
    quantized_linear(out, x, *quantized, bias);
  else
    bf16_linear(out, x, bf16_packed, bias);
}

DecoderStack::DecoderStack(std::vector<DecoderLayerWeights> layers,
                           std::vector<at::Tensor> kv_caches, DecoderStackOptions options)
    : layers_(std::move(layers)), kv_caches_(std::move(kv_caches)), options_(std::move(options)) {
  TORCH_CHECK(layers_.size() == kv_caches_.size(), "DecoderStack: ", layers_.size(),
              " layers but ", kv_caches_.size(), " KV caches");
  TORCH_CHECK(options_.activation == "silu", "DecoderStack: activation '", options_.activation,
              "' has no kernel here; only silu");
  TORCH_CHECK(options_.num_heads > 0 && options_.num_kv_heads > 0 && options_.head_dim > 0 &&
                  options_.intermediate_size > 0,
              "DecoderStack: num_heads, num_kv_heads, head_dim and intermediate_size must be "
              "set");
  for (size_t l = 0; l < layers_.size(); ++l) {
#define LOOM_CHECK_DEFINED(name, doc) \
  TORCH_CHECK(layers_[l].name.defined(), "DecoderStack: layer ", l, " has no " #name);
    LOOM_DECODER_LAYER_REQUIRED(LOOM_CHECK_DEFINED)
#undef LOOM_CHECK_DEFINED
#define LOOM_CHECK_LINEAR(name, doc)                                               \
  TORCH_CHECK(layers_[l].name.has_value() &&                                      \
                  (layers_[l].name->quantized || layers_[l].name->bf16_packed.defined()), \
              "DecoderStack: layer ", l, " has no " #name);
    LOOM_DECODER_LAYER_LINEARS(LOOM_CHECK_LINEAR)
#undef LOOM_CHECK_LINEAR
    TORCH_CHECK(layers_[l].q_norm.has_value() == layers_[l].k_norm.has_value(),
                "DecoderStack: layer ", l, " has one of q_norm and k_norm");
  }
}

std::vector<at::Tensor> DecoderStack::forward(at::Tensor hidden, at::Tensor positions,
                                              at::Tensor cos_sin_cache,
                                              at::Tensor slot_mapping, at::Tensor block_table,
                                              at::Tensor seq_lens,
                                              at::Tensor query_start_loc) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be (T, H), contiguous");
  const DecoderStackOptions& o = options_;
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = o.num_heads * o.head_dim, kv_size = o.num_kv_heads * o.head_dim;
  // a bias in the float32 sum goes to the kernel; one after the rounded product (a
  // row-parallel layer's, added after its all-reduce) is a separate bf16 add
  auto linear = [&](const at::Tensor& x, const c10::optional<LinearWeight>& weight,
                    const c10::optional<at::Tensor>& bias_in_sum,
                    const c10::optional<at::Tensor>& bias_after, int64_t out_features) {
    auto out = at::empty({tokens, out_features}, x.options());
    weight->matmul(out, x, bias_in_sum);
    if (bias_after) out.add_(*bias_after);
    return out;
  };
  const c10::optional<at::Tensor> none;
  at::Tensor residual = hidden;
  at::Tensor x;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DecoderLayerWeights& w = layers_[l];
    if (l == 0)
      x = rms_norm(hidden, w.input_norm, o.rms_norm_eps);
    else
      fused_add_rms_norm(x, residual, w.input_norm, o.rms_norm_eps);
    auto qkv = linear(x, w.qkv, w.qkv_bias, none, q_size + 2 * kv_size);  // | q | k | v |
    at::Tensor q, k;
    if (w.q_norm) {  // per-head RMSNorm on q and k (new tensors), then rope on each
      q = rms_norm(qkv.narrow(1, 0, q_size).view({tokens, o.num_heads, o.head_dim}), *w.q_norm,
                   o.rms_norm_eps);
      k = rms_norm(qkv.narrow(1, q_size, kv_size).view({tokens, o.num_kv_heads, o.head_dim}),
                   *w.k_norm, o.rms_norm_eps);
      rotary_embedding(q, positions, cos_sin_cache);
      rotary_embedding(k, positions, cos_sin_cache);
    } else {  // q and k adjacent in qkv: rope on both in one pass, in place
      auto qk = qkv.narrow(1, 0, q_size + kv_size)
                    .view({tokens, o.num_heads + o.num_kv_heads, o.head_dim});
      rotary_embedding(qk, positions, cos_sin_cache);
      q = qk.narrow(1, 0, o.num_heads);
      k = qk.narrow(1, o.num_heads, o.num_kv_heads);
    }
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, o.num_kv_heads, o.head_dim});
    write_kv_cache(k, v, kv_caches_[l], slot_mapping);
    auto attn = at::empty({tokens, o.num_heads, o.head_dim}, x.options());
    paged_attention(attn, q, kv_caches_[l], block_table, seq_lens, query_start_loc,
                    o.attention_scale, std::numeric_limits<int64_t>::max());
    auto out = linear(attn.view({tokens, q_size}), w.o, none, w.o_bias, width);
    fused_add_rms_norm(out, residual, w.post_attention_norm, o.rms_norm_eps);
    auto act = silu_and_mul(linear(out, w.gate_up, w.gate_up_bias, none, 2 * o.intermediate_size));
    x = linear(act, w.down, none, w.down_bias, width);
  }
  return {x, residual};
}

}  // namespace loom
