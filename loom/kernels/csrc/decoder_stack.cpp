// The native decoder stack (decoder_stack.h): a Llama-style model's decoder layers over
// one step in C++, so that the ~25 small tensor ops per layer cost no Python (about
// 1.1 ms of an 8.9 ms batch-1 step of SmolLM2). Each layer's weights arrive by name,
// filled from the model's declaration; this file is the one place that says what a
// layer does with them.

#include "decoder_stack.h"

#include "bf16_gemm.h"
#include "common.h"
#include "ops.h"

#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <limits>
#include <tuple>
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
  TORCH_CHECK(options_.num_heads > 0 && options_.num_kv_heads > 0 && options_.head_dim > 0,
              "DecoderStack: num_heads, num_kv_heads and head_dim must be set");
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
    const DecoderLayerWeights& w = layers_[l];
    if (w.expert_w13.empty()) {
      TORCH_CHECK(w.gate_up && w.down && options_.intermediate_size > 0, "DecoderStack: layer ",
                  l, " has neither experts nor gate_up and down (and intermediate_size)");
    } else {
      const auto experts = static_cast<size_t>(options_.num_experts);
      TORCH_CHECK(w.router && w.tokens_per_expert && experts > 0 &&
                      w.expert_w13.size() == experts && w.expert_w2.size() == experts,
                  "DecoderStack: layer ", l, " has ", w.expert_w13.size(), "/",
                  w.expert_w2.size(), " experts' w13/w2 (num_experts ", experts,
                  "), a router and tokens_per_expert");
      TORCH_CHECK(options_.top_k > 0 && options_.top_k <= options_.num_experts &&
                      options_.moe_intermediate_size > 0,
                  "DecoderStack: top_k and moe_intermediate_size must be set");
      TORCH_CHECK(options_.scoring == "softmax" || options_.scoring == "sigmoid",
                  "DecoderStack: MoE scoring '", options_.scoring, "': softmax or sigmoid");
      TORCH_CHECK(w.expert_w13_stacked.has_value() == w.expert_w2_stacked.has_value(),
                  "DecoderStack: layer ", l, " has one of expert_w13_stacked and w2_stacked");
      TORCH_CHECK(w.shared_gate_up.has_value() == w.shared_down.has_value() &&
                      (!w.shared_gate_up || options_.shared_intermediate_size > 0),
                  "DecoderStack: layer ", l, " has one of shared_gate_up and shared_down, "
                  "or no shared_intermediate_size");
    }
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
    if (w.expert_w13.empty()) {
      auto act =
          silu_and_mul(linear(out, w.gate_up, w.gate_up_bias, none, 2 * o.intermediate_size));
      x = linear(act, w.down, none, w.down_bias, width);
    } else {
      x = mixture_of_experts(w, out);
      if (w.shared_gate_up) {  // out + shared_experts(out): a new tensor, as the modules
        auto act = silu_and_mul(
            linear(out, w.shared_gate_up, w.shared_gate_up_bias, none,
                   2 * o.shared_intermediate_size));
        x = x.add(linear(act, w.shared_down, none, w.shared_down_bias, width));
      }
    }
  }
  return {x, residual};
}

// FusedMoE.forward (layers/fused_moe.py) for one rank holding every expert, the same
// ATen ops in the same order: router, select_experts, the counts, then fused_experts
// (its one-token path at T == 1, else grouped by expert).
at::Tensor DecoderStack::mixture_of_experts(const DecoderLayerWeights& w,
                                            const at::Tensor& x) const {
  const DecoderStackOptions& o = options_;
  const int64_t tokens = x.size(0), width = x.size(1), top_k = o.top_k;
  const int64_t inter = o.moe_intermediate_size;
  // select_experts: float32 logits, scores, top-k (on scores + bias where there is one)
  auto logits = at::linear(x.to(at::kFloat), *w.router);
  auto scores = o.scoring == "softmax" ? logits.softmax(-1) : logits.sigmoid();
  at::Tensor topk_weights, topk_ids;
  if (w.correction_bias) {
    topk_ids = std::get<1>(at::topk(scores.add(*w.correction_bias), top_k, -1));
    topk_weights = scores.gather(-1, topk_ids);
  } else {
    std::tie(topk_weights, topk_ids) = at::topk(scores, top_k, -1);
  }
  if (o.renormalize) {
    auto total = topk_weights.sum(-1, /*keepdim=*/true);
    if (o.renormalize_min > 0) total = at::clamp(total, c10::Scalar(o.renormalize_min));
    topk_weights = topk_weights.div(total);
  }
  auto flat_ids = topk_ids.flatten();
  auto counts = at::bincount(flat_ids, {}, o.num_experts);  // also fused_experts' segments
  w.tokens_per_expert->add_(counts);
  if (w.step_tokens) w.step_tokens->add_(counts);

  // one expert on rows (R, H): linear -> silu_and_mul -> linear, into `out`
  // (R, H); F.linear on the stacked weights where fused_experts takes it
  auto expert_mlp = [&](at::Tensor out, const at::Tensor& rows, int64_t expert) {
    const int64_t r = rows.size(0);
    const bool plain = w.expert_w13_stacked && r > o.packed_max_rows;
    at::Tensor gate_up;
    if (plain) {
      gate_up = at::linear(rows, w.expert_w13_stacked->select(0, expert));
    } else {
      gate_up = at::empty({r, 2 * inter}, rows.options());
      w.expert_w13[expert].matmul(gate_up, rows, {});
    }
    auto act = silu_and_mul(gate_up);  // silu(gate) * up, each rounded (as two ATen ops)
    if (plain)
      out.copy_(at::linear(act, w.expert_w2_stacked->select(0, expert)));
    else
      w.expert_w2[expert].matmul(out, act, {});
  };

  auto out = at::zeros_like(x);
  if (tokens == 1) {  // _one_token: the experts in id order, each weighed and added
    auto weights = topk_weights.select(0, 0).to(x.scalar_type());
    auto ids = topk_ids.select(0, 0).contiguous();
    std::vector<std::pair<int64_t, int64_t>> chosen;  // (expert, k)
    for (int64_t k = 0; k < top_k; ++k) chosen.emplace_back(ids.data_ptr<int64_t>()[k], k);
    std::stable_sort(chosen.begin(), chosen.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [expert, k] : chosen) {
      auto result = at::empty({1, width}, x.options());
      expert_mlp(result, x, expert);
      out.add_(result.mul_(weights.select(0, k)));
    }
    return out;
  }
  // fused_experts: the T*K assignments sorted by expert, each expert's rows one segment
  auto order = at::argsort(flat_ids, /*stable=*/true);
  auto token_of = order.div(top_k, "floor");
  auto routed = x.index_select(0, token_of);
  auto results = at::empty_like(routed);
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t expert = 0, start = 0; expert < o.num_experts; ++expert) {
    if (count[expert] == 0) continue;
    expert_mlp(results.narrow(0, start, count[expert]), routed.narrow(0, start, count[expert]),
               expert);
    start += count[expert];
  }
  auto weights = topk_weights.flatten().index_select(0, order).to(results.scalar_type());
  results.mul_(weights.unsqueeze(1));
  return out.index_add_(0, token_of, results);
}

}  // namespace loom
