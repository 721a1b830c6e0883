// Neox-style rotary position embedding, in place.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

namespace loom {
namespace {

template <typename T>
void rotate_row(T* row, const float* cs, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(row[i]), x2 = to_float(row[half + i]);
    const float c = cs[i], s = cs[half + i];
    const float o1 = round_to<T>(x1 * c) - round_to<T>(x2 * s);
    const float o2 = round_to<T>(x2 * c) + round_to<T>(x1 * s);
    row[i] = from_float<T>(o1);
    row[half + i] = from_float<T>(o2);
  }
}

}  // namespace

// Neox rotary in place on x (T, N, D) (rows may be strided, last dim contiguous):
// with halves x1, x2 of the first rotary_dim dims and c, s = cos, sin at the token's
// position (float32 cache (2, P, rotary_dim / 2), rounded to x's dtype first),
//   x1' = round(round(x1 c) - round(x2 s)),  x2' = round(round(x2 c) + round(x1 s))
// which is Hugging Face's `x * cos + rotate_half(x) * sin` in x's dtype.
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos_sin_cache) {
  check_cpu(x, "x");
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be (T, N, D) with a contiguous last dim");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  positions = positions.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t half = cos_sin_cache.size(2), max_pos = cos_sin_cache.size(1);
  TORCH_CHECK(2 * half <= x.size(2), "rotary_dim exceeds head_dim");
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  LOOM_DISPATCH(x.scalar_type(), "rotary_embedding", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> cs(2 * half);
      for (int64_t t = begin; t < end; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range");
        const float* c = cache + pos[t] * half;
        const float* s = cache + max_pos * half + pos[t] * half;
        for (int64_t i = 0; i < half; ++i) {
          cs[i] = round_to<scalar_t>(c[i]);
          cs[half + i] = round_to<scalar_t>(s[i]);
        }
        for (int64_t h = 0; h < heads; ++h) rotate_row(xp + t * s0 + h * s1, cs.data(), half);
      }
    });
  });
}

}  // namespace loom
