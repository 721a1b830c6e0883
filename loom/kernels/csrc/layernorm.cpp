// RMSNorm, alone and fused with the residual add of a pre-norm decoder layer.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

namespace loom {
namespace {

// Per row of x (N, H): out = w * round(x * rsqrt(mean(x^2) + eps)), as
// `weight * F.rms_norm(x.float(), eps=eps).to(dtype)`.
template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t hidden, float eps) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_float(x[i]);
    sumsq += v * v;
  }
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    const float normed = round_to<T>(to_float(x[i]) * inv);
    out[i] = from_float<T>(to_float(w[i]) * normed);
  }
}

template <typename T>
void add_into(T* dst, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(to_float(x[i]) + to_float(dst[i]));
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  check_float_or_bf16(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
  x = x.contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  auto out = at::empty_like(x);
  LOOM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(op + r * hidden, xp + r * hidden, wp, hidden, static_cast<float>(eps));
    });
  });
  return out;
}

// residual <- round(x + residual); x <- rms_norm(residual) * w, in place: the
// `x = residual + x; return norm(x), x` of a pre-norm decoder layer.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                        double eps) {
  check_cpu(x, "x");
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "x and residual must be contiguous");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, residual and weight must share a dtype");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  LOOM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * hidden;
        scalar_t* rr = rp + r * hidden;
        add_into(rr, xr, hidden);
        rms_norm_row(xr, rr, wp, hidden, static_cast<float>(eps));
      }
    });
  });
}

}  // namespace loom
