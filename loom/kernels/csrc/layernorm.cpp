// RMSNorm, alone and fused with the residual add of a pre-norm decoder layer.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

namespace loom {
namespace {

// Per row of x (N, H): out = round(w * x * rsqrt(mean(x^2) + eps)), all in float32 and
// rounded once to out's dtype (`(weight.float() * F.rms_norm(x.float(), eps=eps)).to(dtype)`;
// Hugging Face rounds the normed x to the dtype before the weight's multiply, a second
// rounding; in float32 the two are the same); x may be the float32 residual stream of a
// bfloat16 model (In = float, T = bf16).
template <typename T, typename In>
void rms_norm_row(T* out, const In* x, const T* w, int64_t hidden, float eps) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_float(x[i]);
    sumsq += v * v;
  }
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = from_float<T>(to_float(w[i]) * (to_float(x[i]) * inv));
  }
}

template <typename R, typename T>
void add_into(R* dst, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<R>(to_float(x[i]) + to_float(dst[i]));
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

// residual += x; out = rms_norm(residual) * w: the `r = r + x; return norm(r), r` of a
// pre-norm decoder layer. A bfloat16 model's residual stream is float32 (loom keeps it
// so: layers/layernorm.py), and x, the layer's output, float32 from the kernel's sums
// or bfloat16 (an MoE's); out has the weight's dtype and may be x itself.
void add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight,
                  double eps) {
  check_cpu(x, "x");
  check_float_or_bf16(weight, "weight");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && residual.is_contiguous(),
              "out, x and residual must be contiguous");
  TORCH_CHECK(out.scalar_type() == dtype &&
                  (x.scalar_type() == dtype || x.scalar_type() == at::kFloat) &&
                  (residual.scalar_type() == dtype || residual.scalar_type() == at::kFloat),
              "out must have the weight's dtype; x and residual that dtype or float32");
  TORCH_CHECK(x.sizes() == residual.sizes() && out.sizes() == x.sizes(),
              "out, x and residual must have the same shape");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  LOOM_DISPATCH(dtype, "add_rms_norm", [&] {
    auto run = [&](const auto* xp, auto* rp) {
      scalar_t* op = out.data_ptr<scalar_t>();
      const scalar_t* wp = weight.data_ptr<scalar_t>();
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          auto* rr = rp + r * hidden;
          add_into(rr, xp + r * hidden, hidden);  // all of x's row is read before out's
          rms_norm_row(op + r * hidden, rr, wp, hidden, static_cast<float>(eps));
        }
      });
    };
    const bool x_float = x.scalar_type() != dtype, r_float = residual.scalar_type() != dtype;
    if (x_float && r_float)
      run(x.data_ptr<float>(), residual.data_ptr<float>());
    else if (x_float)
      run(x.data_ptr<float>(), residual.data_ptr<scalar_t>());
    else if (r_float)
      run(x.data_ptr<scalar_t>(), residual.data_ptr<float>());
    else
      run(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>());
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                        double eps) {
  add_rms_norm(x, x, residual, weight, eps);
}

}  // namespace loom
