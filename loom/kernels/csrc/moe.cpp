// A mixture of experts' router (layers/fused_moe.py, select_experts) for bf16 hidden
// states: float32 logits, softmax or sigmoid scores, top-k (of the scores plus a
// correction bias where the family has one), the chosen scores renormalized. One token's
// routing is a few thousand multiply-adds and a dozen tiny steps: as ATen ops, ~10 small
// ops per layer at batch 1; here one loop per token. FusedMoE.route (bf16 on the CPU)
// and mixture_of_experts (experts.cpp) both route through it, so the two choose and
// weigh the same.
//
// Each logit is a dot product over the hidden size summed in 16 lanes (input i into
// lane i % 16), the lanes then added in order: the same float32 values on every build,
// not the order of F.linear's (ATen's) sum. Top-k: largest first, ties to the lower
// expert id.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

namespace loom {
namespace {

constexpr int64_t kLanes = 16;

// sum_i x[i] * w[i]: input i into lane i % 16, each lane a float32 sum in order, then
// the lanes added in order. The AVX-512 path computes exactly this, 16 lanes at once.
float logit_dot(const float* x, const float* w, int64_t width) {
  float lanes[kLanes] = {};
  int64_t i = 0;
#if LOOM_HAVE_AVX512_BF16
  __m512 acc = _mm512_setzero_ps();
  for (; i + kLanes <= width; i += kLanes) {
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i)));
  }
  _mm512_storeu_ps(lanes, acc);
#else
  for (; i + kLanes <= width; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * w[i + l];
#endif
  for (int64_t l = 0; i < width; ++i, ++l) lanes[l] += x[i] * w[i];
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

}  // namespace

void moe_route_rows(const c10::BFloat16* x, int64_t ldx, int64_t begin, int64_t end,
                    int64_t width, const float* router, int64_t num_experts, const float* bias,
                    const MoERouting& routing, float* weights, int64_t* ids) {
  const int64_t top_k = routing.top_k;
  std::vector<float> scores(num_experts), keys(num_experts), row(width);
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t i = 0; i < width; ++i) row[i] = to_float(x[t * ldx + i]);
    for (int64_t e = 0; e < num_experts; ++e)
      scores[e] = logit_dot(row.data(), router + e * width, width);
    if (routing.sigmoid) {
      for (auto& s : scores) s = 1.f / (1.f + std::exp(-s));
    } else {
      float top = scores[0];
      for (float s : scores) top = std::max(top, s);
      float total = 0.f;
      for (auto& s : scores) total += (s = std::exp(s - top));
      for (auto& s : scores) s /= total;
    }
    for (int64_t e = 0; e < num_experts; ++e) keys[e] = bias ? scores[e] + bias[e] : scores[e];
    float* w = weights + t * top_k;
    int64_t* chosen = ids + t * top_k;
    float total = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {  // top_k passes: fine for a handful of k
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken |= chosen[j] == e;
        if (!taken && (best < 0 || keys[e] > keys[best])) best = e;
      }
      chosen[k] = best;
      w[k] = scores[best];
      total += w[k];
    }
    if (routing.renormalize) {
      total = std::max(total, static_cast<float>(routing.renormalize_min));
      for (int64_t k = 0; k < top_k; ++k) w[k] /= total;
    }
  }
}

std::vector<at::Tensor> moe_route(at::Tensor x, at::Tensor router,
                                  c10::optional<at::Tensor> correction_bias, int64_t top_k,
                                  const std::string& scoring, bool renormalize,
                                  double renormalize_min) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "moe_route: x must be (T, H) bfloat16");
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1) &&
                  (router.scalar_type() == at::kFloat || router.scalar_type() == at::kBFloat16),
              "moe_route: router must be (E, H) float32 or bfloat16, H that of x");
  TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid",
              "moe_route: scoring '", scoring, "': softmax or sigmoid");
  const int64_t tokens = x.size(0), width = x.size(1), experts = router.size(0);
  TORCH_CHECK(top_k > 0 && top_k <= experts, "moe_route: top_k ", top_k, " of ", experts,
              " experts");
  x = x.contiguous();
  router = router.to(at::kFloat).contiguous();  // a bf16 router's values, exactly
  at::Tensor bias;
  if (correction_bias.has_value() && correction_bias->defined()) {
    TORCH_CHECK(correction_bias->numel() == experts, "moe_route: correction_bias must be (E,)");
    bias = correction_bias->to(at::kFloat).contiguous();
  }
  auto weights = at::empty({tokens, top_k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({tokens, top_k}, x.options().dtype(at::kLong));
  const MoERouting routing{top_k, scoring == "sigmoid", renormalize, renormalize_min};
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    moe_route_rows(x.data_ptr<c10::BFloat16>(), width, begin, end, width,
                   router.data_ptr<float>(), experts, bp, routing, weights.data_ptr<float>(),
                   ids.data_ptr<int64_t>());
  });
  return {weights, ids};
}

}  // namespace loom
