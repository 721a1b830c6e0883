// A mixture of experts' routed experts in one call (experts.h): the routing (moe.cpp),
// the counts, and each chosen expert's matmuls grouped into parallel regions, in the
// order and with the roundings of the PyTorch path (layers/fused_moe.py, fused_experts).

#include "experts.h"

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
    TORCH_CHECK(in.size(1) == 2 * packed.size(1), "mixture_of_experts: expert ", j.expert, " takes ",
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
