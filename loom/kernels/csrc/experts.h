// A mixture of experts' routed experts in one call (experts.cpp), and the handle of a
// linear weight they multiply by: bf16 panels or quantized, in one format or several.
#pragma once

#include <ATen/core/Tensor.h>

#include "quant_gemm.h"

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

// A linear layer's weight as one of the two matmuls holds it: bf16 panels
// (pack_bf16_weight, for bf16_linear) or a QuantizedWeight (for quantized_linear), or,
// for a fused layer whose projections come in different formats (a GGUF Q4_K_M file's
// Q4_K q and k with a Q6_K v), one QuantizedWeight per run of output rows, top to
// bottom, each multiplied into its columns of the output (weight_forms.MixedFormats).
struct LinearWeight {
  at::Tensor bf16_packed;
  c10::optional<QuantizedWeight> quantized;
  std::vector<QuantizedWeight> parts;

  static LinearWeight bf16(at::Tensor packed) { return LinearWeight{std::move(packed), {}, {}}; }
  static LinearWeight of_quantized(QuantizedWeight weight) {
    return LinearWeight{at::Tensor(), std::move(weight), {}};
  }
  static LinearWeight of_parts(std::vector<QuantizedWeight> parts);
  // bf16 panels (not quantized, in one format or several)
  bool is_bf16() const { return !quantized && parts.empty(); }
  bool defined() const { return quantized || !parts.empty() || bf16_packed.defined(); }
  // out (M, N) = x (M, K) @ W^T (+ bias in the float32 sum)
  void matmul(at::Tensor out, at::Tensor x, const c10::optional<at::Tensor>& bias) const;
};

// A mixture of experts' routed experts (layers/fused_moe.py, FusedMoE.forward for one
// rank that holds every expert): x (T, H) bf16 routed over `router` (E, H) float32 (with
// moe_route), the counts added to `tokens_per_expert` (and `step_tokens`), then
// fused_experts' values in its order: at T == 1 the token's experts in turn, else the
// assignments grouped by expert, each expert's w13 and w2 on its segment.
at::Tensor mixture_of_experts(const at::Tensor& x, const at::Tensor& router,
                              const c10::optional<at::Tensor>& correction_bias,
                              const std::vector<LinearWeight>& expert_w13,
                              const std::vector<LinearWeight>& expert_w2,
                              const at::Tensor& tokens_per_expert,
                              const c10::optional<at::Tensor>& step_tokens, int64_t top_k,
                              const std::string& scoring, bool renormalize,
                              double renormalize_min, int64_t intermediate_size);

}  // namespace loom
