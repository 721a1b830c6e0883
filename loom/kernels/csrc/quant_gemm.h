// Matmul with weight-only quantized weights on CPUs with AVX512-BF16, or AVX2 with FMA
// and F16C (quant_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom {

// Whether this build has a kernel (the compiler targeted AVX512-BF16, or AVX2 + FMA + F16C).
bool quant_gemm_available();

// Whether quantized_linear, on `rows` rows (of any format), rounds x to int16 per block
// of 32 features and multiplies integers (the AVX2 kernel always; on AVX-512 where the
// CPU has VNNI, every row count under batch invariance, else 1-8 rows):
// kernel_error_bound adds x's rounding where it does.
bool quant_gemm_rounds_x(int64_t rows);

// A linear layer's quantized weight (N, K) in the kernel's layout, with what the kernel
// needs to read it. Every format loom keeps quantized is one of these: `bits`-wide
// unsigned values q (4, 5, 6 or 8) in groups of `group_size` input features (a multiple
// of 32 at 4 and 5 bits, of 16 at 6 and 8), each group of each output row with a scale d
// and either an offset m (asymmetric: w = d * q + m) or the fixed zero point
// 2^(bits-1) (symmetric: w = d * (q - 2^(bits-1))). Scales (and offsets) are float16,
// float32 when `float_scales` (wint8's per-row scales), or `two_level` (the K-quants):
// an int8 per group times a float16 per 256 features (d = super scale * scale, m =
// super offset * offset, both products exact in float32).
struct QuantizedWeight {
  at::Tensor data;  // uint8, from pack_quantized_weight
  int64_t out_features = 0;
  int64_t in_features = 0;
  int64_t bits = 0;
  int64_t group_size = 0;
  bool asymmetric = false;
  bool float_scales = false;
  bool two_level = false;

  // Weight bytes the kernel reads per step (padding included).
  int64_t nbytes() const { return data.defined() ? data.numel() : 0; }
};

// values uint8 (N, K) in [0, 2^bits); scales (N, K / group_size) float16 or float32;
// offsets (same shape and dtype) for an asymmetric format -> the packed weight.
// Two-level (super_scales given): scales (and offsets) int8, super_scales (and
// super_offsets, with offsets) float16 (N, K / 256).
QuantizedWeight pack_quantized_weight(at::Tensor values, at::Tensor scales,
                                      c10::optional<at::Tensor> offsets, int64_t bits,
                                      c10::optional<at::Tensor> super_scales,
                                      c10::optional<at::Tensor> super_offsets);

// The inverse of pack_quantized_weight: [values, scales, offsets, super_scales,
// super_offsets], each None where the format has none.
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
