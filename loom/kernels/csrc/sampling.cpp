// Greedy sampling's argmax: each row's first largest float32 logit, as torch.argmax.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <limits>

namespace loom {
namespace {

// The generic row: the first largest value, or the first NaN (torch.argmax takes a NaN
// as the largest). Strictly greater replaces, so a tie keeps the earlier index.
int64_t argmax_row(const float* x, int64_t width) {
  int64_t best = 0;
  float value = x[0];
  if (std::isnan(value)) return 0;
  for (int64_t i = 1; i < width; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > value) value = x[i], best = i;
  }
  return best;
}

#if LOOM_HAVE_AVX512_BF16
// 16 lanes, each the generic row over the positions i = lane (mod 16), NaNs only
// noted: the answer is the smallest index among the lanes holding the largest value
// (each lane keeps its first), then the tail, whose indices come later. A row with a
// NaN takes the generic row, which finds the first one.
int64_t argmax_row_avx512(const float* x, int64_t width) {
  if (width < 32) return argmax_row(x, width);
  __m512 best = _mm512_loadu_ps(x);
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  const __m512i sixteen = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= width; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    index = _mm512_add_epi32(index, sixteen);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
  }
  if (nan) return argmax_row(x, width);
  float value = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(value), _CMP_EQ_OQ);
  int64_t result = _mm512_mask_reduce_min_epi32(
      holders, best_index);
  for (; i < width; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > value) value = x[i], result = i;
  }
  return result;
}
#endif

#if defined(__AVX2__)
// argmax_row_avx512's walk on 8 lanes (CPUs without AVX-512): each lane the generic
// row over the positions i = lane (mod 8), NaNs only noted; the answer is the smallest
// index among the lanes holding the largest value, then the tail. A row with a NaN
// takes the generic row. (The generic row took ~50 us of a batch-1 step's 49,152
// logits on a Zen 3 core.)
int64_t argmax_row_avx2(const float* x, int64_t width) {
  if (width < 16) return argmax_row(x, width);
  __m256 best = _mm256_loadu_ps(x);
  __m256i best_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index = best_index;
  const __m256i eight = _mm256_set1_epi32(8);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= width; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    index = _mm256_add_epi32(index, eight);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_index = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), greater));
  }
  if (_mm256_movemask_ps(nan)) return argmax_row(x, width);
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index);
  float value = values[0];
  for (int lane = 1; lane < 8; ++lane) value = std::max(value, values[lane]);
  int64_t result = width;
  for (int lane = 0; lane < 8; ++lane)
    if (values[lane] == value) result = std::min<int64_t>(result, indices[lane]);
  for (; i < width; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > value) value = x[i], result = i;
  }
  return result;
}
#endif

}  // namespace

// logits (R, V) float32, last dim contiguous -> (R,) int64: each row's index of its
// first largest value, or of its first NaN; torch.argmax(logits, -1), read in one pass
// of 16 lanes, or 8 with AVX2 (ATen's CPU argmax compares one element at a time).
at::Tensor argmax_rows(at::Tensor logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "argmax_rows: logits must be (rows, V) float32, V > 0, last dim contiguous");
  const int64_t rows = logits.size(0), width = logits.size(1), ld = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* y = out.data_ptr<int64_t>();
  [[maybe_unused]] const bool avx512 = use_avx512();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if LOOM_HAVE_AVX512_BF16
      if (avx512) {
        y[r] = argmax_row_avx512(x + r * ld, width);
        continue;
      }
#endif
#if defined(__AVX2__)
      y[r] = argmax_row_avx2(x + r * ld, width);
#else
      y[r] = argmax_row(x + r * ld, width);
#endif
    }
  });
  return out;
}

}  // namespace loom
