// The native decoder stack's schema: the named weights of one decoder layer and the
// options of the whole stack. Python fills these by name from the model's declaration
// (loom/model/native_stack.py); each list below is the one place a field is named in
// C++, and the bindings expose every field under that name and the lists themselves as
// `DecoderLayerWeights.fields` / `DecoderStackOptions.fields`, which the Python side
// checks against its roles when it plans the stack.
//
// Adding a weight or an option: one X(...) line here, its role in the model's
// declaration, and the kernel call in decoder_stack.cpp that uses it.
#pragma once

#include <ATen/core/Tensor.h>

#include "quant_gemm.h"

#include <cstdint>
#include <string>
#include <vector>

// X(name, doc): a tensor every layer has.
#define LOOM_DECODER_LAYER_REQUIRED(X)                                                 \
  X(input_norm, "RMSNorm weight before attention, (hidden,)")                        \
  X(post_attention_norm, "RMSNorm weight before the MLP, (hidden,)")

// X(name, doc): a linear layer's weight every layer has (a LinearWeight: bf16 packed
// or quantized).
#define LOOM_DECODER_LAYER_LINEARS(X)                                                  \
  X(qkv, "q|k|v projection")                                                         \
  X(o, "attention output projection")

// X(name, doc): a linear layer's weight some layers have: the dense MLP's (every layer
// without experts), a mixture of experts' shared experts (one MLP, where the family has
// them).
#define LOOM_DECODER_LAYER_OPTIONAL_LINEARS(X)                                         \
  X(gate_up, "gate|up projection of the dense MLP")                                  \
  X(down, "down projection of the dense MLP")                                        \
  X(shared_gate_up, "gate|up projection of the shared experts (MoE layers)")         \
  X(shared_down, "down projection of the shared experts (MoE layers)")

// X(name, doc): a tensor some families have (None where absent).
#define LOOM_DECODER_LAYER_OPTIONAL(X)                                                 \
  X(qkv_bias, "bias of qkv, added in the matmul's float32 sum (Qwen2)")               \
  X(q_norm, "per-head RMSNorm weight on q before rope, (head_dim,) (Qwen3)")         \
  X(k_norm, "per-head RMSNorm weight on k before rope, (head_dim,) (Qwen3)")         \
  X(o_bias, "bias of o, added to the rounded product (as a row-parallel layer does)") \
  X(gate_up_bias, "bias of gate_up, added in the matmul's float32 sum")              \
  X(down_bias, "bias of down, added to the rounded product")                         \
  X(shared_gate_up_bias, "bias of shared_gate_up, added in the matmul's float32 sum") \
  X(shared_down_bias, "bias of shared_down, added to the rounded product")

// X(type, name, doc): a mixture of experts in place of the dense MLP (layers/fused_moe.py,
// FusedMoE): set on the layers that have one (expert_w13 not empty), all of them.
#define LOOM_DECODER_LAYER_MOE(X)                                                      \
  X(c10::optional<at::Tensor>, router, "router weight (E, H), float32")              \
  X(c10::optional<at::Tensor>, correction_bias,                                       \
    "e_score_correction_bias (E,), float32: added to the scores to choose (Ernie)")   \
  X(std::vector<LinearWeight>, expert_w13, "each expert's gate|up weight (2I, H)")    \
  X(std::vector<LinearWeight>, expert_w2, "each expert's down weight (H, I)")         \
  X(c10::optional<at::Tensor>, tokens_per_expert,                                     \
    "(E,) int64 count since start, added to in place (the layer's buffer)")           \
  X(c10::optional<at::Tensor>, step_tokens,                                           \
    "(E,) int64 count of this step, shared by the layers (the model runner's), or None")

// X(type, name, doc): options of the whole stack.
#define LOOM_DECODER_STACK_OPTIONS(X)                                                  \
  X(int64_t, num_heads, "query heads")                                               \
  X(int64_t, num_kv_heads, "key/value heads")                                        \
  X(int64_t, head_dim, "width of one head")                                          \
  X(int64_t, intermediate_size, "MLP width (gate_up has twice as many outputs)")     \
  X(double, attention_scale, "softmax scale of attention, usually head_dim ** -0.5") \
  X(double, rms_norm_eps, "epsilon of every RMSNorm in the stack")                   \
  X(std::string, activation, "MLP activation between gate and up: silu")             \
  X(int64_t, num_experts, "MoE layers: routed experts (0: no MoE layer)")             \
  X(int64_t, top_k, "MoE layers: experts per token")                                 \
  X(int64_t, moe_intermediate_size, "MoE layers: one routed expert's width")         \
  X(int64_t, shared_intermediate_size, "MoE layers: the shared experts' width (0: none)") \
  X(std::string, scoring, "MoE layers: softmax | sigmoid over the router logits")    \
  X(bool, renormalize, "MoE layers: chosen weights divided by their sum")            \
  X(double, renormalize_min, "MoE layers: that sum clamped below (0: not clamped)")

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

struct DecoderLayerWeights {
#define LOOM_REQUIRED_FIELD(name, doc) at::Tensor name;
#define LOOM_LINEAR_FIELD(name, doc) c10::optional<LinearWeight> name;
#define LOOM_OPTIONAL_FIELD(name, doc) c10::optional<at::Tensor> name;
#define LOOM_MOE_FIELD(type, name, doc) type name;
  LOOM_DECODER_LAYER_REQUIRED(LOOM_REQUIRED_FIELD)
  LOOM_DECODER_LAYER_LINEARS(LOOM_LINEAR_FIELD)
  LOOM_DECODER_LAYER_OPTIONAL_LINEARS(LOOM_LINEAR_FIELD)
  LOOM_DECODER_LAYER_OPTIONAL(LOOM_OPTIONAL_FIELD)
  LOOM_DECODER_LAYER_MOE(LOOM_MOE_FIELD)
#undef LOOM_MOE_FIELD
#undef LOOM_REQUIRED_FIELD
#undef LOOM_LINEAR_FIELD
#undef LOOM_OPTIONAL_FIELD
};

struct DecoderStackOptions {
#define LOOM_OPTION_FIELD(type, name, doc) type name{};
  LOOM_DECODER_STACK_OPTIONS(LOOM_OPTION_FIELD)
#undef LOOM_OPTION_FIELD
};

// A model's decoder layers over one step, built once per (weights, KV caches) binding
// and run every step: the same kernels, on the same tensors, in the same order as the
// modules' forward on the CPU (LlamaDecoderLayer with the `cpu` attention backend), so
// the results are identical.
// A mixture of experts' routed experts (layers/fused_moe.py, FusedMoE.forward for one
// rank that holds every expert): x (T, H) bf16 routed over `router` (E, H) float32 (with
// moe_route), the counts added to `tokens_per_expert` (and `step_tokens`), then
// fused_experts' values in its order: at T == 1 the token's experts in turn, else the
// assignments grouped by expert, each expert's w13 and w2 on its segment. The module
// path (FusedMoE.forward, bf16 on the CPU) and the decoder stack both run it.
at::Tensor mixture_of_experts(const at::Tensor& x, const at::Tensor& router,
                              const c10::optional<at::Tensor>& correction_bias,
                              const std::vector<LinearWeight>& expert_w13,
                              const std::vector<LinearWeight>& expert_w2,
                              const at::Tensor& tokens_per_expert,
                              const c10::optional<at::Tensor>& step_tokens, int64_t top_k,
                              const std::string& scoring, bool renormalize,
                              double renormalize_min, int64_t intermediate_size);

class DecoderStack {
 public:
  DecoderStack(std::vector<DecoderLayerWeights> layers, std::vector<at::Tensor> kv_caches,
               DecoderStackOptions options);

  // hidden (T, hidden) -> (hidden, residual) after the last layer, for the final norm.
  std::vector<at::Tensor> forward(at::Tensor hidden, at::Tensor positions,
                                  at::Tensor cos_sin_cache, at::Tensor slot_mapping,
                                  at::Tensor block_table, at::Tensor seq_lens,
                                  at::Tensor query_start_loc) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<DecoderLayerWeights> layers_;
  std::vector<at::Tensor> kv_caches_;
  DecoderStackOptions options_;
};

}  // namespace loom
