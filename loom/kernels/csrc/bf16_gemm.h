// bfloat16 matmul for linear layers on CPUs with AVX512-BF16 (bf16_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

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

// out (M, N) = x (M, K) @ weight^T (+ bias), weight given packed; out bf16 or float32.
void bf16_linear(at::Tensor out, at::Tensor x, at::Tensor packed,
                 c10::optional<at::Tensor> bias);

}  // namespace loom
