// bfloat16 matmul for linear layers on CPUs with AVX512-BF16 (bf16_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace loom {

// Whether this build has the kernel (the compiler targeted AVX512-BF16).
bool bf16_gemm_available();

// Whether bf16_linear (and quantized_linear) may run many rows on the AMX tile units:
// built with AMX, the CPU has it, the OS grants it to this process, and set_bf16_amx
// has not turned it off.
bool bf16_amx_available();

// The LOOM_AMX switch; the Python side sets it when it loads the module.
void set_bf16_amx(bool wanted);

// weight (N, K) bf16, K even -> the panel layout bf16_linear reads.
at::Tensor pack_bf16_weight(at::Tensor weight);

// out (M, K) = rows `ids` (M, int64, each in [0, n)) of the weight (n, K) that `packed`
// holds: an embedding table kept only as a tied LM head's panels.
void bf16_gather_rows(at::Tensor out, at::Tensor packed, at::Tensor ids, int64_t n);

// out (M, N) = x (M, K) @ weight^T (+ bias), weight given packed; out bf16 or float32.
void bf16_linear(at::Tensor out, at::Tensor x, at::Tensor packed,
                 c10::optional<at::Tensor> bias);

// One matmul of a group, on memory its caller keeps alive: out (rows, n) bf16, rows
// `ldy` apart, = x (rows, 2 * pairs) bf16, rows `ldx` apart, @ W^T, W (n, 2 * pairs)
// as pack_bf16_weight lays it out (`panels` panels of `pairs` pairs of inputs).
struct Bf16Matmul {
  const c10::BFloat16* x;
  int64_t ldx, rows;
  const c10::BFloat16* packed;
  int64_t pairs, panels;
  void* out;
  int64_t ldy, n;
};

// Several bf16_linear calls (bf16 out, no bias) in one parallel region, e.g. the experts
// a token was routed to: each matmul's values are exactly those of bf16_linear on it
// alone (the same cut into row chunks, the same kernels); their panels are one list
// split over the threads, so a thread streams one matmul's weights after another's
// without a fork and join between (a batch-1 step of benchmarks/moe_speed.py's MoE runs
// 4 experts' w13 of 2 MB each per layer: one region instead of 4).
void bf16_linear_group(const std::vector<Bf16Matmul>& matmuls);

// out = x @ W^T as one matmul of a group, the arguments checked as bf16_linear checks
// them (out bf16); the tensors must outlive the group's call.
Bf16Matmul bf16_matmul(at::Tensor out, at::Tensor x, at::Tensor packed);

}  // namespace loom
