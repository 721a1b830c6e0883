// SiLU(gate) * up, the activation of a gated MLP.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <type_traits>

namespace loom {
namespace {

// round(round(silu(gate)) * up) in T, as `F.silu(gate) * up` in the storage dtype.
template <typename T>
inline T silu_mul_scalar(T gate, T up) {
  const float g = to_float(gate);
  const float silu = round_to<T>(g / (1.f + fast_exp(-g)));
  return from_float<T>(silu * to_float(up));
}

#if LOOM_HAVE_AVX512_BF16
// The generic row's operations on 16 lanes (bf16 rounding by vcvtneps2bf16, which also
// flushes float32 denormals: results differ only below 1.2e-38).
void silu_and_mul_row_avx512(c10::BFloat16* out, const c10::BFloat16* gate, int64_t width) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 g = bf16x16_to_float(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                       fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 rounded = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(float_to_bf16x16(silu)), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        float_to_bf16x16(_mm512_mul_ps(rounded, bf16x16_to_float(gate + width + i))));
  }
  for (; i < width; ++i) out[i] = silu_mul_scalar(gate[i], gate[width + i]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// silu_and_mul_row_avx512 on 8 lanes (CPUs without AVX512-BF16), the same bits.
void silu_and_mul_row_avx2(c10::BFloat16* out, const c10::BFloat16* gate, int64_t width) {
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 g = bf16x8_to_float(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                       fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    const __m256 rounded = _mm256_castsi256_ps(float_to_bf16_bits8(silu));
    store_bf16x8(out + i, float_to_bf16_bits8(_mm256_mul_ps(rounded, bf16x8_to_float(gate + width + i))));
  }
  for (; i < width; ++i) out[i] = silu_mul_scalar(gate[i], gate[width + i]);
}
#endif

// The generic row: float32 everywhere, and bf16 on CPUs with neither AVX512-BF16 nor
// AVX2 (with AVX2, silu_and_mul_row_avx2 above; under set_isa("generic") too).
template <typename T>
void silu_and_mul_row(T* out, const T* gate, int64_t width) {
  const T* up = gate + width;
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = silu_mul_scalar(gate[i], up[i]);
}

// Rows [begin, end) of x (N, 2I) into out (N, I), on one path for all of them.
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t begin, int64_t end, int64_t width,
                       [[maybe_unused]] bool avx512) {
#if LOOM_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (avx512) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_row_avx512(out + r * width, x + r * 2 * width, width);
      return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t r = begin; r < end; ++r)
      silu_and_mul_row_avx2(out + r * width, x + r * 2 * width, width);
    return;
  }
#endif
  for (int64_t r = begin; r < end; ++r) silu_and_mul_row(out + r * width, x + r * 2 * width, width);
}

}  // namespace

// x (N, 2I) = [gate | up] -> (N, I) = round(round(silu(gate)) * up), as
// `F.silu(gate) * up` in the storage dtype.
at::Tensor silu_and_mul(at::Tensor x) {
  check_cpu(x, "x");
  check_float_or_bf16(x, "x");
  x = x.contiguous();
  const int64_t width = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, x.options());
  [[maybe_unused]] const bool avx512 = use_avx512();
  LOOM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      silu_and_mul_rows(op, xp, begin, end, width, avx512);
    });
  });
  return out;
}

}  // namespace loom
