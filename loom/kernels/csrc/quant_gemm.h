// Matmul with weight-only quantized weights on CPUs with AVX512-BF16 (quant_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom {

// Whether this build has the kernel (the compiler targeted AVX512-BF16).
bool quant_gemm_available();

// A linear layer's quantized weight (N, K) in the kernel's layout, with what the kernel
// needs to read it. Every format loom keeps quantized is one of these: `bits`-wide
// unsigned values q (4 or 8) in groups of `group_size` input features (a multiple of
// 32 at 4 bits, of 16 at 8), each group of each output row with a scale d and either
// an offset m (asymmetric: w = d * q + m) or the fixed zero point 2^(bits-1)
// (symmetric: w = d * (q - 2^(bits-1))). Scales (and offsets) are float16, or float32
// when `float_scales` (wint8's per-row scales; the K-quants' multiplied-out ones).
struct QuantizedWeight {
  at::Tensor data;  // uint8, from pack_quantized_weight
  int64_t out_features = 0;
  int64_t in_features = 0;
  int64_t bits = 0;
  int64_t group_size = 0;
  bool asymmetric = false;
  bool float_scales = false;

  // Weight bytes the kernel reads per step (padding included).
  int64_t nbytes() const { return data.defined() ? data.numel() : 0; }
};

// values uint8 (N, K) in [0, 2^bits); scales (N, K / group_size) float16 or float32;
// offsets (same shape and dtype) for an asymmetric format -> the packed weight.
QuantizedWeight pack_quantized_weight(at::Tensor values, at::Tensor scales,
                                      c10::optional<at::Tensor> offsets, int64_t bits);

// The inverse of pack_quantized_weight: [values, scales, offsets or None].
std::vector<c10::optional<at::Tensor>> unpack_quantized_weight(const QuantizedWeight& weight);

// out (len(ids), K) = rows `ids` of the weight, dequantized (an embedding lookup from
// a quantized table; each value as QuantizedTensor.dequantize computes it, rounded once
// to out's dtype).
void dequantize_rows(at::Tensor out, const QuantizedWeight& weight, at::Tensor ids);

// out (M, N) = x (M, K) @ W^T (+ bias); x bfloat16, out bfloat16 or float32: float32
// sums of exact products, no activation quantized.
void quantized_linear(at::Tensor out, at::Tensor x, const QuantizedWeight& weight,
                      c10::optional<at::Tensor> bias);

}  // namespace loom
