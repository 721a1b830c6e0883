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
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace loom {

LinearWeight LinearWeight::of_parts(std::vector<QuantizedWeight> parts) {
  TORCH_CHECK(!parts.empty(), "LinearWeight.quantized_parts: no parts");
  for (const auto& part : parts)
    TORCH_CHECK(part.data.defined() && part.in_features == parts[0].in_features,
                "LinearWeight.quantized_parts: every part takes the same input features");
  return LinearWeight{at::Tensor(), {}, std::move(parts)};
}

void LinearWeight::matmul(at::Tensor out, at::Tensor x,
                          const c10::optional<at::Tensor>& bias) const {
  if (quantized) {
    quantized_linear(out, x, *quantized, bias);
  } else if (!parts.empty()) {  // each part into its columns of out (and of the bias)
    int64_t first = 0;
    for (const auto& part : parts) first += part.out_features;
    TORCH_CHECK(first == out.size(1), "LinearWeight: parts of ", first, " outputs, out has ",
                out.size(1));
    first = 0;
    for (const auto& part : parts) {
      const int64_t n = part.out_features;
      c10::optional<at::Tensor> part_bias;
      if (bias && bias->defined()) part_bias = bias->narrow(0, first, n);
      quantized_linear(out.narrow(1, first, n), x, part, part_bias);
      first += n;
    }
  } else {
    bf16_linear(out, x, bf16_packed, bias);
  }
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
  TORCH_CHECK(layers_[l].name.has_value() && layers_[l].name->defined(),          \
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
      TORCH_CHECK(w.router->scalar_type() == at::kFloat && w.router->is_contiguous() &&
                      w.router->size(0) == options_.num_experts &&
                      (!w.correction_bias || (w.correction_bias->scalar_type() == at::kFloat &&
                                              w.correction_bias->is_contiguous())),
                  "DecoderStack: layer ", l, "'s router and correction_bias must be float32, "
                  "contiguous, one row per expert");
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
  // (a layer's last linears, o and down, write their float32 sums: they join the
  // float32 residual stream unrounded, as the modules' RowParallelLinear(float_output))
  // `reuse`, where given: an output allocated by the first layer and written again by
  // every later one (its last value is read before the next layer writes it). An
  // at::empty per activation per layer was 240 a batch-1 step of the default model.
  auto linear = [&](const at::Tensor& x, const c10::optional<LinearWeight>& weight,
                    const c10::optional<at::Tensor>& bias_in_sum,
                    const c10::optional<at::Tensor>& bias_after, int64_t out_features,
                    bool float_output = false, at::Tensor* reuse = nullptr) {
    const auto options = float_output ? x.options().dtype(at::kFloat) : x.options();
    at::Tensor out;
    if (reuse && reuse->defined() && reuse->dtype() == options.dtype() &&
        reuse->size(1) == out_features)
      out = *reuse;
    else
      out = at::empty({tokens, out_features}, options);
    if (reuse) *reuse = out;
    weight->matmul(out, x, bias_in_sum);
    if (bias_after) out.add_(*bias_after);
    return out;
  };
  const c10::optional<at::Tensor> none;
  at::Tensor residual = hidden.to(at::kFloat);  // the stream in float32 (a copy for bf16)
  at::Tensor x;
  at::Tensor qkv_out, o_out, gate_up_out, down_out;  // reused by every layer (`linear`)
  at::Tensor normed_buf, attn_buf, out_buf;
  auto reused = [&](at::Tensor& buf, at::IntArrayRef sizes) {
    if (!buf.defined()) buf = at::empty(sizes, hidden.options());
    return buf;
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DecoderLayerWeights& w = layers_[l];
    if (l == 0) {
      x = rms_norm(hidden, w.input_norm, o.rms_norm_eps);
    } else {
      auto normed = x.scalar_type() == hidden.scalar_type() ? x : reused(normed_buf, {tokens, width});
      add_rms_norm(normed, x, residual, w.input_norm, o.rms_norm_eps);
      x = normed;
    }
    auto qkv = linear(x, w.qkv, w.qkv_bias, none, q_size + 2 * kv_size, false,
                      &qkv_out);  // | q | k | v |
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
    auto attn = reused(attn_buf, {tokens, o.num_heads, o.head_dim});
    paged_attention(attn, q, kv_caches_[l], block_table, seq_lens, query_start_loc,
                    o.attention_scale, std::numeric_limits<int64_t>::max());
    auto attn_out = linear(attn.view({tokens, q_size}), w.o, none, w.o_bias, width, true, &o_out);
    auto out = reused(out_buf, {tokens, width});
    add_rms_norm(out, attn_out, residual, w.post_attention_norm, o.rms_norm_eps);
    if (w.expert_w13.empty()) {
      auto act = silu_and_mul(linear(out, w.gate_up, w.gate_up_bias, none,
                                     2 * o.intermediate_size, false, &gate_up_out));
      x = linear(act, w.down, none, w.down_bias, width, true, &down_out);
    } else {
      x = mixture_of_experts(out, *w.router, w.correction_bias, w.expert_w13, w.expert_w2,
                             *w.tokens_per_expert, w.step_tokens, o.top_k, o.scoring,
                             o.renormalize, o.renormalize_min, o.moe_intermediate_size);
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

namespace {

// Rows of one expert's input run through that expert's matmul into rows of `out`.
struct ExpertRows {
  int64_t expert, in_row, out_row, rows;
};

// Each ExpertRows' matmul: bf16 experts all in one parallel region (bf16_linear_group,
// the values of a bf16_linear call per expert), quantized ones one call each.
void run_experts(const std::vector<LinearWeight>& weights, const std::vector<ExpertRows>& jobs,
                 const at::Tensor& in, at::Tensor out) {
  const bool bf16 = std::all_of(jobs.begin(), jobs.end(), [&](const ExpertRows& j) {
    return weights[j.expert].is_bf16();
  });
  if (!bf16) {
    for (const auto& j : jobs)
      weights[j.expert].matmul(out.narrow(0, j.out_row, j.rows), in.narrow(0, j.in_row, j.rows),
                               {});
    return;
  }
  std::vector<Bf16Matmul> matmuls;
  matmuls.reserve(jobs.size());
  const auto* x = in.data_ptr<c10::BFloat16>();
  auto* y = out.data_ptr<c10::BFloat16>();
  for (const auto& j : jobs) {
    const at::Tensor& packed = weights[j.expert].bf16_packed;
    TORCH_CHECK(in.size(1) == 2 * packed.size(1), "DecoderStack: expert ", j.expert, " takes ",
                2 * packed.size(1), " features, its input has ", in.size(1));
    matmuls.push_back({x + j.in_row * in.stride(0), in.stride(0), j.rows,
                       packed.data_ptr<c10::BFloat16>(), packed.size(1), packed.size(0),
                       y + j.out_row * out.stride(0), out.stride(0), out.size(1)});
  }
  bf16_linear_group(matmuls);
}

// mixture_of_experts' one-token path (FusedMoE._one_token) without ATen's small ops: the
// token routed in one loop, its chosen experts' w13 in one parallel region, one
// silu_and_mul over their rows, their w2 in one region, then in expert id order each
// result weighed and added, rounded to bf16 at each step as `out += result.mul_(w)`.
at::Tensor one_token_experts(const at::Tensor& x, const at::Tensor& router,
                             const c10::optional<at::Tensor>& correction_bias,
                             const std::vector<LinearWeight>& expert_w13,
                             const std::vector<LinearWeight>& expert_w2,
                             const at::Tensor& tokens_per_expert,
                             const c10::optional<at::Tensor>& step_tokens,
                             const MoERouting& routing, int64_t intermediate_size) {
  const int64_t width = x.size(1), top_k = routing.top_k, num_experts = router.size(0);
  std::vector<float> weights(top_k);
  std::vector<int64_t> ids(top_k);
  moe_route_rows(x.data_ptr<c10::BFloat16>(), width, 0, 1, width, router.data_ptr<float>(),
                 num_experts, correction_bias ? correction_bias->data_ptr<float>() : nullptr,
                 routing, weights.data(), ids.data());
  int64_t* counted = tokens_per_expert.data_ptr<int64_t>();
  int64_t* step = step_tokens ? step_tokens->data_ptr<int64_t>() : nullptr;
  for (const int64_t expert : ids) {
    ++counted[expert];
    if (step) ++step[expert];
  }
  std::vector<int64_t> order(top_k);  // k in expert id order
  for (int64_t k = 0; k < top_k; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<ExpertRows> gate_up_jobs, down_jobs;
  for (int64_t j = 0; j < top_k; ++j) {
    gate_up_jobs.push_back({ids[order[j]], 0, j, 1});
    down_jobs.push_back({ids[order[j]], j, j, 1});
  }
  auto gate_up = at::empty({top_k, 2 * intermediate_size}, x.options());
  run_experts(expert_w13, gate_up_jobs, x, gate_up);
  auto act = silu_and_mul(gate_up);
  auto results = at::empty({top_k, width}, x.options());
  run_experts(expert_w2, down_jobs, act, results);
  std::vector<float> scale(top_k);  // the weights as bf16, as `topk_weights.to(x.dtype)`
  for (int64_t j = 0; j < top_k; ++j)
    scale[j] = to_float(from_float<c10::BFloat16>(weights[order[j]]));
  auto out = at::empty({1, width}, x.options());
  auto* y = out.data_ptr<c10::BFloat16>();
  const auto* r = results.data_ptr<c10::BFloat16>();
  for (int64_t h = 0; h < width; ++h) {
    float sum = 0.f;  // out starts at zero
    for (int64_t j = 0; j < top_k; ++j) {
      const float weighed = to_float(from_float<c10::BFloat16>(to_float(r[j * width + h]) * scale[j]));
      sum = to_float(from_float<c10::BFloat16>(sum + weighed));
    }
    y[h] = from_float<c10::BFloat16>(sum);
  }
  return out;
}

}  // namespace

// FusedMoE.forward (layers/fused_moe.py) for one rank holding every expert: the same
// routing (moe_route), the same counts, then fused_experts' values in its order (its
// one-token path at T == 1, else grouped by expert).
at::Tensor mixture_of_experts(const at::Tensor& x, const at::Tensor& router,
                              const c10::optional<at::Tensor>& correction_bias,
                              const std::vector<LinearWeight>& expert_w13,
                              const std::vector<LinearWeight>& expert_w2,
                              const at::Tensor& tokens_per_expert,
                              const c10::optional<at::Tensor>& step_tokens, int64_t top_k,
                              const std::string& scoring, bool renormalize,
                              double renormalize_min, int64_t intermediate_size) {
  const int64_t num_experts = router.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "mixture_of_experts: x must be (T, H) bf16, contiguous");
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.is_contiguous() &&
                  router.size(1) == x.size(1) &&
                  (!correction_bias || (correction_bias->scalar_type() == at::kFloat &&
                                        correction_bias->is_contiguous())),
              "mixture_of_experts: router (E, H) and correction_bias (E,) must be float32, "
              "contiguous");
  TORCH_CHECK(static_cast<int64_t>(expert_w13.size()) == num_experts &&
                  static_cast<int64_t>(expert_w2.size()) == num_experts,
              "mixture_of_experts: ", expert_w13.size(), "/", expert_w2.size(),
              " experts' w13/w2 for a router of ", num_experts);
  TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid",
              "mixture_of_experts: scoring '", scoring, "': softmax or sigmoid");
  TORCH_CHECK(top_k > 0 && top_k <= num_experts && intermediate_size > 0,
              "mixture_of_experts: top_k in 1..", num_experts, " and intermediate_size > 0");
  TORCH_CHECK(tokens_per_expert.scalar_type() == at::kLong &&
                  tokens_per_expert.numel() == num_experts,
              "mixture_of_experts: tokens_per_expert must be (E,) int64");
  if (x.size(0) == 1)
    return one_token_experts(x, router, correction_bias, expert_w13, expert_w2,
                             tokens_per_expert, step_tokens,
                             MoERouting{top_k, scoring == "sigmoid", renormalize, renormalize_min},
                             intermediate_size);
  auto routed_by = moe_route(x, router, correction_bias, top_k, scoring, renormalize,
                             renormalize_min);
  const at::Tensor& topk_weights = routed_by[0];
  auto flat_ids = routed_by[1].flatten();
  auto counts = at::bincount(flat_ids, {}, num_experts);  // also fused_experts' segments
  tokens_per_expert.add_(counts);
  if (step_tokens) step_tokens->add_(counts);

  // fused_experts: the T*K assignments sorted by expert, each expert's rows one segment;
  // all segments' w13 in one parallel region, one silu_and_mul, all their w2 in one
  auto order = at::argsort(flat_ids, /*stable=*/true);
  auto token_of = order.div(top_k, "floor");
  auto routed = x.index_select(0, token_of);  // (T*K, H)
  std::vector<ExpertRows> segments;
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t expert = 0, start = 0; expert < num_experts; start += count[expert++])
    if (count[expert]) segments.push_back({expert, start, start, count[expert]});
  auto gate_up = at::empty({routed.size(0), 2 * intermediate_size}, x.options());
  run_experts(expert_w13, segments, routed, gate_up);
  auto act = silu_and_mul(gate_up);
  auto results = at::empty_like(routed);
  run_experts(expert_w2, segments, act, results);
  auto weights = topk_weights.flatten().index_select(0, order).to(results.scalar_type());
  results.mul_(weights.unsqueeze(1));
  return at::zeros_like(x).index_add_(0, token_of, results);
}

}  // namespace loom
