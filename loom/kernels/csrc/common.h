// Helpers shared by loom's CPU kernels: the dtype dispatch, bf16 <-> float, exp, row
// loads and dots, argument checks, their 16-lane AVX-512 twins, and the switch between
// a kernel's AVX-512 and generic paths.
//
// Every kernel takes float32 or bfloat16 and computes in float32; a bf16 result is
// rounded once where the PyTorch reference rounds (documented per kernel), so bf16
// outputs match the reference ops they replace. Parallel loops use ATen's thread pool
// (at::parallel_for), the same threads as torch's own ops.
//
// Kernel files include ATen's headers, not <torch/extension.h>: that one (the whole C++
// frontend) costs ~35 s of compiler time per file. torch_bindings.cpp includes torch's
// pybind11 glue alone.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LOOM_HAVE_AVX512_BF16 1
#else
#define LOOM_HAVE_AVX512_BF16 0
#endif

// float32 and bfloat16 only: the dtypes loom runs on the CPU.
#define LOOM_DISPATCH(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                       \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace loom {

// ---------------------------------------------------------------- instruction set

// The kernels with an AVX512-BF16 path (bf16 SiLU*mul; bf16 paged attention at head_dim
// 32, 64, 128; LoRA's lora_add and lora_embedding_add) keep the generic C++ path that
// every other CPU runs. The build picks the AVX-512 one where the compiler targets it
// (-march=native on such a CPU); a test can force the generic one with the module's
// set_isa("generic"), so that one build runs and compares both
// (tests/model/test_kernel_paths.py, test_lora_slots.py). For tests only: serving never
// calls it. Kernels read it once per call; a replayed forward (replay.h) follows it
// through the kernels it calls. bf16_linear has its AVX512-BF16 path only.
inline std::atomic<bool> force_generic_isa{false};

inline bool use_avx512() {
  return LOOM_HAVE_AVX512_BF16 && !force_generic_isa.load(std::memory_order_relaxed);
}

// Batch invariance (loom/envs.py's LOOM_BATCH_INVARIANT, set once when the module loads;
// on by default): every kernel gives a row the same bits whatever the other rows of its
// call are. quantized_linear then takes its integer path at every row count and
// bf16_linear keeps off the AMX tiles. Off, calls of more rows take faster paths whose
// sums round differently (the bf16 quantized path, the tiles).
inline std::atomic<bool> batch_invariance{true};

inline bool batch_invariant() { return batch_invariance.load(std::memory_order_relaxed); }

// ---------------------------------------------------------------- scalar helpers

// Scalar helpers written so that `#pragma omp simd` loops over them vectorize:
// bf16 <-> float as integer shifts (round to nearest even, NaN kept), and an exp
// without libm calls (max error about 2 ulp; 0 below -87.3, as float underflows).
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Round through the storage type: identity for float, round-to-nearest-even for bf16.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

inline float fast_exp(float x) {
  // exp(x) = 2^n * exp(r), r = x - n ln2 in [-ln2/2, ln2/2], exp(r) by a degree-6 polynomial
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, clamped));
  float p = 1.3888889e-3f;
  p = std::fma(p, r, 8.3333333e-3f);
  p = std::fma(p, r, 4.1666667e-2f);
  p = std::fma(p, r, 1.6666667e-1f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return x < -87.3f ? 0.f : p * scale;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  // four independent sums: one vector's chain of FMAs made a 64-wide dot wait out eight
  // FMA latencies (the generic attention's q.k on AVX2 CPUs)
  if (n % 32 == 0) {
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t i = 0; i < n; i += 32)
      for (int c = 0; c < 4; ++c)
        s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * c), _mm256_loadu_ps(b + i + 8 * c), s[c]);
    const __m256 v = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

inline void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// Rows [0, rows) in blocks of at most `most`, as even as that allows (at most 6: 8 = 4 +
// 4, not 6 + 2, whose 2-row block is 8 dependent vdpbf16ps chains for 6 loads; at most
// 8: 12 = 6 + 6): f(first row, rows in the block). The micro-kernels' row blocks
// (quant_gemm.cpp, bf16_gemm.cpp).
template <typename F>
inline void even_row_blocks(int64_t rows, int64_t most, F&& f) {
  const int64_t blocks = (rows + most - 1) / most;
  for (int64_t b = 0, r = 0, mr = 0; b < blocks; ++b, r += mr) {
    mr = (rows - r + (blocks - b) - 1) / (blocks - b);
    f(r, mr);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------- 8-lane helpers (AVX2)

// fast_exp on 8 lanes, operation for operation (the same bits).
inline __m256 fast_exp8(__m256 x) {
  const __m256 clamped =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f),
                                   _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), clamped));
  __m256 p = _mm256_set1_ps(1.3888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline __m256 bf16x8_to_float(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 8 floats -> 8 bf16 as from_float rounds them (to nearest even; NaN -> 0x7fc0), as
// float32 lanes holding the bf16 bits in their high half.
inline __m256i float_to_bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
      _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}

inline void store_bf16x8(c10::BFloat16* p, __m256i high_halves) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(high_halves, 16), _mm256_setzero_si256());
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
#endif

#if LOOM_HAVE_AVX512_BF16
// ---------------------------------------------------------------- 16-lane helpers

// fast_exp on 16 lanes, operation for operation.
inline __m512 fast_exp16(__m512 x) {
  const __m512 clamped =
      _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), clamped));
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));
}

inline __m512 bf16x16_to_float(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m256i float_to_bf16x16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#endif

// A quantized KV cache row (kv_layout.py): head_dim one-byte values, then their float32
// scale in the row's last 4 bytes; value = q * scale. The cache tensor's dtype names the
// values' format: int8 (q in [-127, 127]), float8_e4m3fn or float8_e5m2 (q an fp8 number,
// |q| <= 448 or 57344). Quantized per (token, head): scale = max |x| / qmax (at least
// FLT_MIN), q = x / scale rounded to nearest even (int8: to an integer; fp8: to the
// format, c10's conversion), as the torch backend's quantize_kv_rows does it, bit for bit.
constexpr int64_t kKvScaleBytes = 4;

enum class KvFormat { kNone, kInt8, kFp8E4M3, kFp8E5M2 };

inline KvFormat kv_format(at::ScalarType cache_dtype) {
  switch (cache_dtype) {
    case at::kChar: return KvFormat::kInt8;
    case at::kFloat8_e4m3fn: return KvFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return KvFormat::kFp8E5M2;
    default: return KvFormat::kNone;
  }
}

// The 256 values of an fp8 format's bytes, as float32 (exact; c10's conversion).
inline const float* fp8_table(KvFormat format) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int b = 0; b < 256; ++b) {
      t[0][b] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      t[1][b] = static_cast<float>(
          c10::Float8_e5m2(static_cast<uint8_t>(b), c10::Float8_e5m2::from_bits()));
    }
    return t;
  }();
  return tables[format == KvFormat::kFp8E4M3 ? 0 : 1].data();
}

template <typename T>
inline void quantize_kv_row(const T* src, char* dst, int64_t head_dim, KvFormat format) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(to_float(src[d])));
  const float qmax = format == KvFormat::kInt8      ? 127.f
                     : format == KvFormat::kFp8E4M3 ? 448.f
                                                    : 57344.f;
  const float scale = std::max(amax / qmax, std::numeric_limits<float>::min());
  for (int64_t d = 0; d < head_dim; ++d) {
    const float x = to_float(src[d]) / scale;
    if (format == KvFormat::kInt8) {
      const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x)));
      dst[d] = static_cast<char>(static_cast<int8_t>(q));
    } else if (format == KvFormat::kFp8E4M3) {
      dst[d] = static_cast<char>(c10::Float8_e4m3fn(x).x);
    } else {
      dst[d] = static_cast<char>(c10::Float8_e5m2(x).x);
    }
  }
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

// An fp8 format's bytes as float32, exactly, 16 or 8 lanes at a time, with integer
// operations and exact products only (so no denormal arithmetic, whatever MXCSR says): a
// normal value's exponent and mantissa bits moved into a float's, its exponent rebased
// (bias 7 or 15 -> 127); a subnormal one (exponent field 0) is its mantissa m as a float
// times 2^-9 (E4M3) or 2^-16 (E5M2); the sign bit moved to bit 31. The NaN and infinity
// codes are never written (|q| <= QMAX).
struct Fp8Bits {
  int shift;            // a byte's exponent and mantissa bits -> a float's
  int32_t subnormal;    // magnitudes below this have exponent field 0
  int32_t rebase;       // (127 - bias) << 23
  float unit;           // a subnormal's mantissa step
};

inline Fp8Bits fp8_bits(KvFormat format) {
  return format == KvFormat::kFp8E4M3 ? Fp8Bits{20, 8, 120 << 23, 1.f / 512}
                                      : Fp8Bits{21, 4, 112 << 23, 1.f / 65536};
}

#if LOOM_HAVE_AVX512_BF16
inline __m512 fp8x16_to_float(__m128i bytes, const Fp8Bits& f) {
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(
      _mm512_sll_epi32(mag, _mm_cvtsi32_si128(f.shift)), _mm512_set1_epi32(f.rebase)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(f.unit));
  const __m512 x = _mm512_mask_blend_ps(
      _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(f.subnormal)), normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 fp8x8_to_float(__m128i bytes, const Fp8Bits& f) {
  const __m256i v = _mm256_cvtepu8_epi32(bytes);
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(
      _mm256_sll_epi32(mag, _mm_cvtsi32_si128(f.shift)), _mm256_set1_epi32(f.rebase)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(f.unit));
  const __m256 is_sub =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(f.subnormal), mag));
  const __m256 x = _mm256_blendv_ps(normal, sub, is_sub);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(x, _mm256_castsi256_ps(sign));
}
#endif

// A quantized row back in the model's dtype: float32 q * scale, rounded once to T (16
// lanes at a time with AVX512-BF16, 8 with AVX2: the same bits, q * scale being 0 or
// a normal float; an fp8 row's q * scale is subnormal only in a row whose max |x| is
// below 1e-28, which a model's K/V never is). fp8 values: fp8x16_to_float /
// fp8x8_to_float, and the table (fp8_table) for the last head_dim % 8.
template <typename T>
inline void dequantize_kv_row(const char* src, T* dst, int64_t head_dim, KvFormat format) {
  float scale;
  std::memcpy(&scale, src + head_dim, sizeof(scale));
  const bool int8 = format == KvFormat::kInt8;
  [[maybe_unused]] const Fp8Bits bits = fp8_bits(format);
  int64_t d = 0;
#if LOOM_HAVE_AVX512_BF16
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (; d + 16 <= head_dim; d += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    const __m512 q = int8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
                          : fp8x16_to_float(bytes, bits);
    const __m512 x = _mm512_mul_ps(q, scale16);
    if constexpr (std::is_same_v<T, float>)
      _mm512_storeu_ps(dst + d, x);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), float_to_bf16x16(x));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (; d + 8 <= head_dim; d += 8) {
    int64_t eight;
    std::memcpy(&eight, src + d, sizeof(eight));
    const __m128i bytes = _mm_cvtsi64_si128(eight);
    const __m256 q = int8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
                          : fp8x8_to_float(bytes, bits);
    const __m256 x = _mm256_mul_ps(q, scale8);
    if constexpr (std::is_same_v<T, float>)
      _mm256_storeu_ps(dst + d, x);
    else
      store_bf16x8(dst + d, float_to_bf16_bits8(x));
  }
#endif
  if (d == head_dim) return;
  const float* table = int8 ? nullptr : fp8_table(format);
  for (; d < head_dim; ++d) {
    const float q = int8 ? static_cast<float>(static_cast<int8_t>(src[d]))
                         : table[static_cast<uint8_t>(src[d])];
    dst[d] = from_float<T>(q * scale);
  }
}

}  // namespace loom
