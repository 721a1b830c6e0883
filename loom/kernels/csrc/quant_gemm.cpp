// y = x W^T (+ bias) for weight-only quantized W (4- or 8-bit values in groups with
// float16/float32 scales) and bfloat16 x, on CPUs with AVX512-BF16.
//
// One kernel for every format loom keeps quantized (quant_gemm.h): GGUF's Q8_0, Q4_0,
// Q4_1, Q4_K, Q5_K (5-bit values held in 8) and Q6_K (6-bit values in 8, groups of 16)
// and loom's wint8 and wint4 all read as w = d * q + m per group, with the offset m
// stored (asymmetric) or fixed at -d * 2^(bits-1) (symmetric). Per group g of
// each output row, with bfloat16 x as it comes:
//
//     y[n] += d[n,g] * S[n,g] + m[n,g] * X[g],   S = sum_{k in g} q'[n,k] x[k],
//                                                X = sum_{k in g} x[k]
//
// where q' is q as a bfloat16 integer (exact: 4-bit values through a 16-entry table,
// 8-bit ones stored as q - 128 and converted through float32) and S comes from
// vdpbf16ps: every product exact, float32 sums. So the result differs from
// dequantize-then-matmul in float32 only by float32 rounding: no activation is
// quantized. (The first version quantized x per block of 32 to int8 for VNNI dot
// products, as llama.cpp does: an error of up to half a step, 1/254 of the block's
// largest |x|, on every input; SmolLM2's MLP inputs reach 3,000 in a few channels,
// which wipes out the rest of their blocks. Its error on the default model's first
// layer was 0.2-0.8% of each linear's largest output; this kernel's is float32 rounding.)
//
// One row streams each weight byte once and unpacks it in registers (a block of 32
// features of 16 outputs: 4-bit 8 loads, 56 unpacking instructions, 16 vdpbf16ps);
// more than 6 rows unpack a panel of 16 outputs once into a thread's buffer (in L2) and
// run every 6 rows over it, so the unpacking is paid once per panel, not per 6 rows.
// On the AMX tiles, up to 32 rows (one block) of 4-bit values unpack it 256 features at
// a time into L1 instead, each chunk right before its tile products.
// No dequantized copy of the weights is kept anywhere.
//
// Layout (pack_quantized_weight): panels of 16 output rows; in a panel, group after
// group: its blocks (256 bytes each), then 16 scales, then 16 offsets if asymmetric.
// "Pair vector" j holds in word 2i + c feature 2j + c of row i (the two bf16 a
// vdpbf16ps lane multiplies). 4-bit block: 32 features, 16 pair vectors as 8 chunks of
// 32 bytes, chunk c's byte t holding word t of vector c in its low nibble and of vector
// c + 8 in its high one. 8-bit block: 16 features, 8 pair vectors of 32 int8 bytes,
// q - 128, in word order (so an 8-bit group may be 16 features: Q6_K's).

#include "quant_gemm.h"

#include "amx.h"
#include "bf16_gemm.h"
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LOOM_HAVE_QUANT_GEMM 1
#else
#define LOOM_HAVE_QUANT_GEMM 0
#endif

namespace loom {
namespace {

constexpr int64_t kLanes = 16;       // output rows per panel: one float32 vector
constexpr int64_t kBlockBytes = 256; // a block: 32 features of 16 rows at 4 bits, 16 at 8
constexpr int64_t kRowBlock = 6;     // rows per micro-kernel call
constexpr int64_t kMaxRowChunk = 96;
// Bytes ahead of the block being read that a streaming row (no unpacked panel) asks the
// cache for. The hardware prefetcher alone left one thread at ~5 GB/s from memory (the
// default model's Q8_0 LM head at batch 1: 2.95 ms for 30 MB on 2 threads); 4-8 KB ahead
// gave 1.8 ms. (benchmarks/quantized.md, 2026-12-02.)
constexpr int64_t kPrefetch = 8192;

// Input features per block: 4-bit blocks pack pair vectors c and c + 8 in one chunk
// (32 features); 8-bit ones are 8 vectors (16 features), so that an 8-bit group can be
// 16 features (Q6_K's).
int64_t block_features(int64_t bits) { return bits == 4 ? 32 : 16; }

int64_t panel_bytes(int64_t k, int64_t bits, int64_t group_size, bool asymmetric,
                    bool float_scales) {
  const int64_t groups = k / group_size;
  const int64_t scale_bytes = kLanes * (float_scales ? 4 : 2) * (asymmetric ? 2 : 1);
  return groups * ((group_size / block_features(bits)) * kBlockBytes + scale_bytes);
}

// x (M, K) bf16 -> xsum float (M, K / group_size): x summed over each group.
void group_sums(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t k,
                int64_t group_size, float* xsum) {
  const int64_t groups = k / group_size;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const c10::BFloat16* src = x + r * ldx + g * group_size;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < group_size; ++i) sum += to_float(src[i]);
        xsum[r * groups + g] = sum;
      }
  });
}

#if LOOM_HAVE_QUANT_GEMM
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

template <typename ScaleT>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (std::is_same_v<ScaleT, float>)
    return _mm512_loadu_ps(p);
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A 4-bit chunk's 32 bytes -> its two pair vectors as bf16 16 + q (exact): each byte
// widened to a word, a nibble shifted into mantissa bits 3-6 of bf16 16.0 (0x4180, whose
// mantissa step is 1/8, so 8 q there adds q) and the rest masked off in one vpternlog.
// Five instructions, one of them on port 5, for 64 values (a table lookup through
// vpermw took seven, four on port 5). The 16 is taken back with the group's sum of x
// (kNibbleBias below).
inline void nibbles_to_bf16(const uint8_t* p, __m512i& low, __m512i& high) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mask = _mm512_set1_epi16(0x0078), bias = _mm512_set1_epi16(0x4180);
  low = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, bias, 0xEA);  // (a & b) | c
  high = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, bias, 0xEA);
}
constexpr float kNibbleBias = 16.f;  // nibbles_to_bf16 gives 16 + q

// 32 int8 -> 32 bf16 (exact), in order.
inline __m512bh int8x32_to_bf16(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
}

// A panel's values as bf16 pair vectors, in feature order (vector `pair` holds
// features 2 pair, 2 pair + 1 of the 16 rows): what micro_kernel<..., true> reads
// instead of unpacking each block again for every 6 rows.
template <int BITS>
void unpack_panel(const uint8_t* panel, int64_t groups, int64_t blocks_per_group,
                  int64_t scale_bytes, __m512i* out) {
  const uint8_t* p = panel;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < blocks_per_group; ++i, out += BITS == 4 ? 16 : 8) {
      if constexpr (BITS == 4) {
        for (int c = 0; c < 8; ++c) nibbles_to_bf16(p + 32 * c, out[c], out[c + 8]);
        p += 256;
      } else {
        for (int j = 0; j < 8; ++j) out[j] = (__m512i)int8x32_to_bf16(p + 32 * j);
        p += 256;
      }
    }
    p += scale_bytes;
  }
}

// Rows [0, MR) of x times one panel: `cols` (<= 16) outputs per row. UNPACKED: the
// panel's values come from `unpacked` (unpack_panel), its scales from `panel`.
template <int BITS, bool ASYM, typename ScaleT, int MR, typename OutT, bool UNPACKED>
void micro_kernel(const uint8_t* panel, const __m512i* unpacked, int64_t groups,
                  int64_t blocks_per_group, const c10::BFloat16* x, int64_t ldx,
                  const float* xsum, const float* bias, OutT* y, int64_t ldy, int64_t cols) {
  constexpr int P = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;  // partial sums per row
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  const uint8_t* p = panel;
  constexpr int kPairs = BITS == 4 ? 16 : 8;  // pair vectors per block
  int64_t pair = 0;  // index of the next pair of features
  for (int64_t g = 0; g < groups; ++g) {
    // P partial sums per row, so that P * MR vdpbf16ps chains run side by side: with
    // one chain per row, a row alone waits out the instruction's latency at every
    // product (batch 1 streamed 6.6 GB/s per core, bound by that chain, not by memory).
    __m512 part[MR][P];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < P; ++q) part[r][q] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks_per_group; ++i, pair += kPairs) {
      if constexpr (UNPACKED) {
        for (int j = 0; j < kPairs; ++j) {
          const __m512bh w = (__m512bh)_mm512_load_si512(unpacked + pair + j);
          for (int r = 0; r < MR; ++r)
            part[r][j % P] = _mm512_dpbf16_ps(
                part[r][j % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + j]), w);
        }
        p += kBlockBytes;
      } else if constexpr (BITS == 4) {
        for (int l = 0; l < kBlockBytes; l += 64) prefetch(p + kPrefetch + l);
        for (int c = 0; c < 8; ++c) {
          __m512i v0, v1;
          nibbles_to_bf16(p + 32 * c, v0, v1);
          const __m512bh w0 = (__m512bh)v0, w1 = (__m512bh)v1;
          for (int r = 0; r < MR; ++r) {
            part[r][(2 * c) % P] = _mm512_dpbf16_ps(
                part[r][(2 * c) % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + c]), w0);
            part[r][(2 * c + 1) % P] = _mm512_dpbf16_ps(
                part[r][(2 * c + 1) % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + c + 8]), w1);
          }
        }
        p += 256;
      } else {
        for (int l = 0; l < kBlockBytes; l += 64) prefetch(p + kPrefetch + l);
        for (int j = 0; j < 8; ++j) {
          const __m512bh w = int8x32_to_bf16(p + 32 * j);
          for (int r = 0; r < MR; ++r)
            part[r][j % P] = _mm512_dpbf16_ps(
                part[r][j % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + j]), w);
        }
        p += 256;
      }
    }
    __m512 sum[MR];
    for (int r = 0; r < MR; ++r) {
      for (int q = P / 2; q > 0; q /= 2)  // a fixed tree: the same order every call
        for (int t = 0; t < q; ++t) part[r][t] = _mm512_add_ps(part[r][t], part[r][t + q]);
      sum[r] = part[r][0];
    }
    const __m512 d = load_scales<ScaleT>(p);
    p += kLanes * sizeof(ScaleT);
    if constexpr (ASYM) {
      __m512 m = load_scales<ScaleT>(p);
      p += kLanes * sizeof(ScaleT);
      // 8-bit values are stored q - 128: w = d (q - 128) + (m + 128 d); 4-bit ones
      // come as 16 + q: w = d (16 + q) + (m - 16 d)
      if constexpr (BITS == 8) m = _mm512_fmadd_ps(d, _mm512_set1_ps(128.f), m);
      if constexpr (BITS == 4) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(kNibbleBias), m);
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]),
                                 _mm512_fmadd_ps(d, sum[r], acc[r]));
    } else if constexpr (BITS == 4) {  // w = d * (q - 8) = d * ((16 + q) - 24)
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(
            d, _mm512_sub_ps(sum[r], _mm512_set1_ps((kNibbleBias + 8.f) * xsum[r * groups + g])),
            acc[r]);
    } else {  // stored q - 128 already
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(d, sum[r], acc[r]);
    }
  }
  const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 add = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) {
    const __m512 v = _mm512_add_ps(acc[r], add);
    if constexpr (std::is_same_v<OutT, float>)
      _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    else
      _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

#if LOOM_HAVE_AMX
// Rows [0, rows) of x times one panel of 16 outputs on the AMX tiles, from the panel's
// values unpacked to bf16 integers (`unpacked`, pair vector after pair vector: 16 of
// them are one B tile, 64 bytes apart). `unpacked` null (4-bit, at most 32 rows):
// the panel is unpacked here 256 features at a time into an 8 KB buffer that stays in
// L1, each chunk right before its tile products. (The whole panel unpacked first is
// 32 KB per 1,024 features: written to L2 and read back by the tile loads. Q4_0 16,384
// x 2,048 at 8 rows, one thread, a standalone copy of this code: 3.5 -> 2.2 ms,
// benchmarks/quantized.md.) Per group, the tiles give S for up to 32 rows
// (C tiles 0-1, A tiles 2-3, B tile 4: the group's pairs, 16 at a time), then S leaves
// the tiles and the group's scales and offsets apply in float32 exactly as the AVX-512
// micro-kernel applies them: only S's float32 sums come in another order.
template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void amx_rows_times_panel(const uint8_t* panel, const __m512i* unpacked, int64_t groups,
                          int64_t blocks_per_group, const c10::BFloat16* x, int64_t ldx,
                          const float* xsum, int64_t rows, const float* bias, OutT* y,
                          int64_t ldy, int64_t cols, int64_t& configured) {
  const int64_t group_pairs = blocks_per_group * (BITS == 4 ? 16 : 8);
  const int64_t step = std::min<int64_t>(group_pairs, 16);  // pairs per tile product
  const int64_t block_bytes = blocks_per_group * kBlockBytes;
  const int64_t x_stride = ldx * 2;
  const int64_t scale_bytes = kLanes * sizeof(ScaleT) * (ASYM ? 2 : 1);
  const int64_t chunk_groups = std::max<int64_t>(1, 128 / group_pairs);  // 256 features
  thread_local std::vector<__m512i> chunk;
  if (!unpacked) {
    TORCH_CHECK(rows <= 32, "amx_rows_times_panel: unpacking by chunks takes one block of rows");
    if (static_cast<int64_t>(chunk.size()) < chunk_groups * group_pairs)
      chunk.resize(chunk_groups * group_pairs);
  }
  alignas(64) float sums[32][kLanes];
  alignas(64) float acc[32][kLanes];
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const int64_t m = std::min<int64_t>(32, rows - r0);
    const uint8_t m0 = static_cast<uint8_t>(std::min<int64_t>(m, 16));
    const uint8_t m1 = static_cast<uint8_t>(m - m0);
    const uint16_t a_bytes = static_cast<uint16_t>(step * 4);
    amx::configure(m * 64 + step, configured, {m0, m1, m0, m1, static_cast<uint8_t>(step), 0, 0, 0},
                   {64, 64, a_bytes, a_bytes, 64, 0, 0, 0});
    for (int64_t r = 0; r < m; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    const c10::BFloat16* xb = x + r0 * ldx;
    const float* xs = xsum + r0 * groups;
    const uint8_t* p = panel;
    for (int64_t g = 0; g < groups; ++g) {
      if (!unpacked && g % chunk_groups == 0)
        unpack_panel<BITS>(panel + g * (block_bytes + scale_bytes),
                           std::min(chunk_groups, groups - g), blocks_per_group, scale_bytes,
                           chunk.data());
      const __m512i* values =
          unpacked ? unpacked + g * group_pairs : chunk.data() + (g % chunk_groups) * group_pairs;
      _tile_zero(0);
      if (m1) _tile_zero(1);
      for (int64_t s = 0; s < group_pairs; s += step) {
        const int64_t pair = g * group_pairs + s;
        _tile_loadd(4, values + s, 64);
        _tile_loadd(2, xb + 2 * pair, x_stride);
        _tile_dpbf16ps(0, 2, 4);
        if (m1) {
          _tile_loadd(3, xb + 16 * ldx + 2 * pair, x_stride);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
      _tile_stored(0, sums[0], sizeof(sums[0]));
      if (m1) _tile_stored(1, sums[16], sizeof(sums[0]));
      p += block_bytes;
      const __m512 d = load_scales<ScaleT>(p);
      p += kLanes * sizeof(ScaleT);
      __m512 offset = _mm512_setzero_ps();
      if constexpr (ASYM) {
        offset = load_scales<ScaleT>(p);
        p += kLanes * sizeof(ScaleT);
        if constexpr (BITS == 8) offset = _mm512_fmadd_ps(d, _mm512_set1_ps(128.f), offset);
        if constexpr (BITS == 4)
          offset = _mm512_fnmadd_ps(d, _mm512_set1_ps(kNibbleBias), offset);
      }
      for (int64_t r = 0; r < m; ++r) {
        const __m512 sum = _mm512_load_ps(sums[r]);
        __m512 a = _mm512_load_ps(acc[r]);
        if constexpr (ASYM)
          a = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[r * groups + g]),
                              _mm512_fmadd_ps(d, sum, a));
        else if constexpr (BITS == 4)
          a = _mm512_fmadd_ps(
              d, _mm512_sub_ps(sum, _mm512_set1_ps((kNibbleBias + 8.f) * xs[r * groups + g])), a);
        else
          a = _mm512_fmadd_ps(d, sum, a);
        _mm512_store_ps(acc[r], a);
      }
    }
    const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
    const __m512 add = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < m; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(acc[r]), add);
      OutT* out = y + (r0 + r) * ldy;
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_mask_storeu_ps(out, mask, v);
      else
        _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}
#endif

template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void rows_times_panel(const uint8_t* panel, int64_t groups, int64_t blocks_per_group,
                      const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t rows,
                      const float* bias, OutT* y, int64_t ldy, int64_t cols, bool amx,
                      int64_t& configured) {
  // More than one block of rows: unpack the panel once (K / 2 vectors, 32 KB per 1,024
  // features, in L2) and let every block of rows read it, rather than unpack it again
  // per 6 rows (batch 32: 6 unpackings of each weight instead of 1).
  const __m512i* unpacked = nullptr;
  // One block of 4-bit rows on the tiles unpacks by chunks (amx_rows_times_panel). 8-bit
  // values (their unpacking through float32 costs more than the L2 round trip it saves)
  // measured no faster that way (benchmarks/quantized.md): whole panel first.
  const bool by_chunks = amx && rows <= 32 && BITS == 4;
  if (rows > kRowBlock && !by_chunks) {
    thread_local std::vector<__m512i> buffer;
    const int64_t vectors = groups * blocks_per_group * (BITS == 4 ? 16 : 8);
    if (static_cast<int64_t>(buffer.size()) < vectors) buffer.resize(vectors);
    unpack_panel<BITS>(panel, groups, blocks_per_group,
                       kLanes * sizeof(ScaleT) * (ASYM ? 2 : 1), buffer.data());
    unpacked = buffer.data();
  }
#if LOOM_HAVE_AMX
  if (amx) {
    amx_rows_times_panel<BITS, ASYM, ScaleT, OutT>(panel, unpacked, groups, blocks_per_group,
                                                   x, ldx, xsum, rows, bias, y, ldy, cols,
                                                   configured);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; r += kRowBlock) {
#define LOOM_MICRO(MR)                                                                    \
  do {                                                                                    \
    if (unpacked)                                                                         \
      micro_kernel<BITS, ASYM, ScaleT, MR, OutT, true>(panel, unpacked, groups,           \
                                                       blocks_per_group, x + r * ldx, ldx, \
                                                       xsum + r * groups, bias, y + r * ldy, \
                                                       ldy, cols);                        \
    else                                                                                  \
      micro_kernel<BITS, ASYM, ScaleT, MR, OutT, false>(panel, nullptr, groups,           \
                                                        blocks_per_group, x + r * ldx, ldx, \
                                                        xsum + r * groups, bias,          \
                                                        y + r * ldy, ldy, cols);          \
  } while (0)
    switch (std::min(kRowBlock, rows - r)) {
      case 6: LOOM_MICRO(6); break;
      case 5: LOOM_MICRO(5); break;
      case 4: LOOM_MICRO(4); break;
      case 3: LOOM_MICRO(3); break;
      case 2: LOOM_MICRO(2); break;
      default: LOOM_MICRO(1); break;
    }
#undef LOOM_MICRO
  }
}

// Without the tiles, more than one block of rows runs kQuad panels (64 outputs) at a
// time, bf16_gemm.cpp's blocking: 6 rows x 64 outputs of sums in 24 registers, so a
// pair of features costs 4 vector loads and 6 broadcasts for 24 vdpbf16ps (one panel at
// a time: 1 load and 6 broadcasts for 6, and 6 dependent chains that wait out the
// instruction's latency). The panels are unpacked a chunk of ~256 features at a time
// into a 32 KB buffer that stays in L1 while every block of rows reads it; per group,
// the 24 sums are scaled into float32 accumulators kept in a thread buffer, exactly as
// micro_kernel scales them. Measured on the 2-core Zen 5 VM (AVX512-BF16, no AMX), a 1B
// Llama's fused gate/up (16,384 x 2,048) in Q4_0: see benchmarks/quantized.md.
constexpr int64_t kQuad = 4;                 // panels per wide micro-kernel call
constexpr int64_t kChunkFeatures = 256;      // features unpacked per chunk
constexpr int64_t kWideMaxGroup = 512;       // larger groups (wint8's whole rows) stay per panel

// Rows [0, MR) times the chunk's `chunk_groups` groups (starting at group g0) of kQuad
// panels: values from `unpacked` (panel v's pairs at unpacked + v * chunk_pairs), scales
// from `scales[v]` (panel v's first scale of group g0; `group_stride` bytes per group);
// acc (MR x 64 floats, row stride 64) accumulates the scaled sums.
template <int BITS, bool ASYM, typename ScaleT, int MR>
void wide_kernel(const __m512i* unpacked, int64_t chunk_pairs, const uint8_t* const* scales,
                 int64_t group_stride, int64_t g0, int64_t chunk_groups, int64_t group_pairs,
                 const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t groups,
                 float* acc) {
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  for (int64_t gi = 0; gi < chunk_groups; ++gi) {
    __m512 part[MR][kQuad];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kQuad; ++v) part[r][v] = _mm512_setzero_ps();
    const __m512i* w = unpacked + gi * group_pairs;
    const int64_t pair0 = (g0 + gi) * group_pairs;  // x's pair index
    for (int64_t j = 0; j < group_pairs; ++j, ++w) {
      const __m512bh w0 = (__m512bh)_mm512_load_si512(w);
      const __m512bh w1 = (__m512bh)_mm512_load_si512(w + chunk_pairs);
      const __m512bh w2 = (__m512bh)_mm512_load_si512(w + 2 * chunk_pairs);
      const __m512bh w3 = (__m512bh)_mm512_load_si512(w + 3 * chunk_pairs);
      for (int r = 0; r < MR; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][pair0 + j]);
        part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, w0);
        part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, w1);
        part[r][2] = _mm512_dpbf16_ps(part[r][2], xb, w2);
        part[r][3] = _mm512_dpbf16_ps(part[r][3], xb, w3);
      }
    }
    const int64_t g = g0 + gi;
    for (int v = 0; v < kQuad; ++v) {
      const uint8_t* sp = scales[v] + gi * group_stride;
      const __m512 d = load_scales<ScaleT>(sp);
      __m512 m = _mm512_setzero_ps();
      if constexpr (ASYM) {
        m = load_scales<ScaleT>(sp + kLanes * sizeof(ScaleT));
        if constexpr (BITS == 8) m = _mm512_fmadd_ps(d, _mm512_set1_ps(128.f), m);
        if constexpr (BITS == 4) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(kNibbleBias), m);
      }
      for (int r = 0; r < MR; ++r) {
        float* a = acc + r * 64 + 16 * v;
        const float xs = xsum[r * groups + g];
        __m512 sum = part[r][v];
        if constexpr (!ASYM && BITS == 4)  // w = d * (q - 8) = d * ((16 + q) - 24)
          sum = _mm512_sub_ps(sum, _mm512_set1_ps((kNibbleBias + 8.f) * xs));
        __m512 out = _mm512_fmadd_ps(d, sum, _mm512_load_ps(a));
        if constexpr (ASYM) out = _mm512_fmadd_ps(m, _mm512_set1_ps(xs), out);
        _mm512_store_ps(a, out);
      }
    }
  }
}

// All `rows` rows (more than kRowBlock) times kQuad panels starting at `panel` (`count`
// of them real: a last, partial quad repeats its last panel, whose outputs are not
// written), writing `cols` (<= 64) outputs per row.
template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void rows_times_quad(const uint8_t* panel, int64_t stride, int64_t count, int64_t groups,
                     int64_t blocks_per_group, const c10::BFloat16* x, int64_t ldx,
                     const float* xsum, int64_t rows, const float* bias, OutT* y, int64_t ldy,
                     int64_t cols, bool prefetch_next_quad) {
  const int64_t group_pairs = blocks_per_group * (BITS == 4 ? 16 : 8);
  const int64_t scale_bytes = kLanes * sizeof(ScaleT) * (ASYM ? 2 : 1);
  const int64_t group_stride = blocks_per_group * kBlockBytes + scale_bytes;
  const int64_t chunk_groups = std::max<int64_t>(1, kChunkFeatures / (2 * group_pairs));
  const int64_t chunk_pairs = chunk_groups * group_pairs;
  thread_local std::vector<__m512i> buffer;
  thread_local std::vector<__m512> sums;  // rows x 64 float32 accumulators
  if (static_cast<int64_t>(buffer.size()) < kQuad * chunk_pairs) buffer.resize(kQuad * chunk_pairs);
  if (static_cast<int64_t>(sums.size()) < rows * kQuad) sums.resize(rows * kQuad);
  float* acc = reinterpret_cast<float*>(sums.data());
  std::fill(acc, acc + rows * 64, 0.f);
  const uint8_t* panels[kQuad];
  for (int64_t v = 0; v < kQuad; ++v) panels[v] = panel + std::min(v, count - 1) * stride;
  for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
    const int64_t gn = std::min(chunk_groups, groups - g0);
    const uint8_t* scales[kQuad];
    for (int64_t v = 0; v < kQuad; ++v) {
      const uint8_t* start = panels[v] + g0 * group_stride;
      unpack_panel<BITS>(start, gn, blocks_per_group, scale_bytes, buffer.data() + v * chunk_pairs);
      scales[v] = start + blocks_per_group * kBlockBytes;
    }
    // The next chunk of each panel (or the next quad's first), asked for now: four
    // streams of 2 KB are too short for the hardware prefetcher, and unpacking them as
    // they come waited on memory (a 1B gate/up at 8 rows, one thread: half the time).
    const int64_t chunk_bytes = gn * group_stride;
    for (int64_t v = 0; v < kQuad; ++v) {
      const uint8_t* next = g0 + chunk_groups < groups ? panels[v] + (g0 + chunk_groups) * group_stride
                                                       : panel + (kQuad + v) * stride;
      if (g0 + chunk_groups >= groups && !prefetch_next_quad) break;
      for (int64_t l = 0; l < chunk_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T0);
    }
    for (int64_t r = 0; r < rows; r += kRowBlock) {
#define LOOM_WIDE(MR)                                                                     \
  wide_kernel<BITS, ASYM, ScaleT, MR>(buffer.data(), chunk_pairs, scales, group_stride, g0, gn, \
                                      group_pairs, x + r * ldx, ldx, xsum + r * groups,   \
                                      groups, acc + r * 64)
      switch (std::min(kRowBlock, rows - r)) {
        case 6: LOOM_WIDE(6); break;
        case 5: LOOM_WIDE(5); break;
        case 4: LOOM_WIDE(4); break;
        case 3: LOOM_WIDE(3); break;
        case 2: LOOM_WIDE(2); break;
        default: LOOM_WIDE(1); break;
      }
#undef LOOM_WIDE
    }
  }
  for (int64_t v = 0; v < kQuad; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 out = _mm512_add_ps(_mm512_load_ps(acc + r * 64 + 16 * v), add);
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, out);
      else
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void run_gemm(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx, const float* xsum,
              int64_t rows, const float* bias, OutT* y, int64_t ldy) {
  const int64_t n = w.out_features, panels = w.data.size(0), stride = w.data.size(1);
  const int64_t groups = w.in_features / w.group_size;
  const int64_t blocks_per_group = w.group_size / block_features(BITS);
  const auto* data = w.data.data_ptr<uint8_t>();
  // The tiles take 8 rows or more when a group's pairs fill whole tile products (16 at
  // a time, or Q6_K's 8).
  const int64_t group_pairs = w.group_size / 2;
  const bool amx = rows >= amx::kMinRows && (group_pairs % 16 == 0 || group_pairs == 8) &&
                   bf16_amx_available();
  const int64_t block = amx ? 32 : kRowBlock;
  const int64_t chunks = (rows + kMaxRowChunk - 1) / kMaxRowChunk;
  const int64_t chunk_rows = ((rows + chunks - 1) / chunks + block - 1) / block * block;
  if (!amx && rows > kRowBlock && w.group_size <= kWideMaxGroup) {
    const int64_t quads = (panels + kQuad - 1) / kQuad;
    at::parallel_for(0, chunks * quads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t chunk = item / quads, q = item % quads;
        const int64_t r0 = chunk * chunk_rows, nrows = std::min(chunk_rows, rows - r0);
        if (nrows <= 0) continue;
        const int64_t p = q * kQuad;
        rows_times_quad<BITS, ASYM, ScaleT, OutT>(
            data + p * stride, stride, std::min(kQuad, panels - p), groups, blocks_per_group,
            x + r0 * ldx, ldx, xsum + r0 * groups, nrows, bias ? bias + p * kLanes : nullptr,
            y + r0 * ldy + p * kLanes, ldy, std::min(kQuad * kLanes, n - p * kLanes),
            item + 1 < end && q + 1 < quads && p + 2 * kQuad <= panels);
      }
    });
    return;
  }
  // Work item (chunk of rows, panel), panels inner: with few rows each thread takes a
  // contiguous run of panels and reads only its share of the weights.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = -1;  // this thread's tile shapes
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, p = item % panels;
      const int64_t r0 = chunk * chunk_rows, nrows = std::min(chunk_rows, rows - r0);
      if (nrows <= 0) continue;
      rows_times_panel<BITS, ASYM, ScaleT, OutT>(
          data + p * stride, groups, blocks_per_group, x + r0 * ldx, ldx, xsum + r0 * groups,
          nrows, bias ? bias + p * kLanes : nullptr, y + r0 * ldy + p * kLanes, ldy,
          std::min(kLanes, n - p * kLanes), amx, configured);
    }
#if LOOM_HAVE_AMX
    amx::release(configured);
#endif
  });
}

template <typename OutT>
void dispatch_gemm(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx,
                   const float* xsum, int64_t rows, const float* bias, OutT* y, int64_t ldy) {
#define LOOM_RUN(BITS, ASYM, SCALE) \
  return run_gemm<BITS, ASYM, SCALE, OutT>(w, x, ldx, xsum, rows, bias, y, ldy)
  if (w.bits == 4 && w.asymmetric && !w.float_scales) LOOM_RUN(4, true, c10::Half);
  if (w.bits == 4 && !w.asymmetric && !w.float_scales) LOOM_RUN(4, false, c10::Half);
  if (w.bits == 8 && !w.asymmetric && !w.float_scales) LOOM_RUN(8, false, c10::Half);
  if (w.bits == 8 && !w.asymmetric && w.float_scales) LOOM_RUN(8, false, float);
  if (w.bits == 4 && w.asymmetric && w.float_scales) LOOM_RUN(4, true, float);
  if (w.bits == 8 && w.asymmetric && w.float_scales) LOOM_RUN(8, true, float);
#undef LOOM_RUN
  TORCH_CHECK(false, "quantized_linear: no kernel for ", w.bits, "-bit ",
              w.asymmetric ? "asymmetric" : "symmetric", " weights with ",
              w.float_scales ? "float32" : "float16", " scales");
}
#endif

}  // namespace

bool quant_gemm_available() { return LOOM_HAVE_QUANT_GEMM; }

QuantizedWeight pack_quantized_weight(at::Tensor values, at::Tensor scales,
                                      c10::optional<at::Tensor> offsets, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_quantized_weight: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kByte && values.dim() == 2,
              "values must be a 2-d uint8 CPU tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == values.size(0) &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "scales must be (N, groups) float16 or float32");
  const bool asymmetric = offsets.has_value() && offsets->defined();
  if (asymmetric)
    TORCH_CHECK(offsets->sizes() == scales.sizes() &&
                    offsets->scalar_type() == scales.scalar_type(),
                "offsets must have the shape and dtype of scales");
  const int64_t n = values.size(0), k = values.size(1), groups = scales.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % block_features(bits) == 0,
              "pack_quantized_weight: ", k, " input features in ", groups,
              " groups: each group must be a multiple of ", block_features(bits),
              " features at ", bits, " bits");
  QuantizedWeight w;
  w.out_features = n;
  w.in_features = k;
  w.bits = bits;
  w.group_size = k / groups;
  w.asymmetric = asymmetric;
  w.float_scales = scales.scalar_type() == at::kFloat;
  const int64_t panels = (n + kLanes - 1) / kLanes;
  const int64_t stride = panel_bytes(k, bits, w.group_size, asymmetric, w.float_scales);
  w.data = at::zeros({panels, stride}, values.options());
  const auto v = values.contiguous();
  const auto s = scales.contiguous();
  const auto o = asymmetric ? offsets->contiguous() : at::Tensor();
  const auto* vp = v.data_ptr<uint8_t>();
  const auto* sp = static_cast<const uint8_t*>(s.data_ptr());
  const auto* op = asymmetric ? static_cast<const uint8_t*>(o.data_ptr()) : nullptr;
  auto* out = w.data.data_ptr<uint8_t>();
  const int64_t scale_size = s.element_size();
  const int64_t features = block_features(bits);
  const int64_t blocks_per_group = w.group_size / features;
  const int64_t limit = (1 << bits) - 1;
  TORCH_CHECK(v.max().item<uint8_t>() <= limit, "values must be below 2^", bits);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* dst = out + p * stride;
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < blocks_per_group; ++i) {
          const int64_t k0 = (g * blocks_per_group + i) * features;
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const int64_t row = p * kLanes + lane;
            if (row >= n) continue;
            const uint8_t* src = vp + row * k + k0;
            // word t = 2 * lane + e of pair vector j holds feature 2j + e
            for (int64_t j = 0; j < features / 2; ++j)
              for (int64_t e = 0; e < 2; ++e) {
                const uint8_t q = src[2 * j + e];
                const int64_t t = 2 * lane + e;
                if (bits == 8)
                  dst[32 * j + t] = static_cast<uint8_t>(static_cast<int>(q) - 128);
                else if (j < 8)
                  dst[32 * j + t] |= q;
                else
                  dst[32 * (j - 8) + t] |= static_cast<uint8_t>(q << 4);
              }
          }
          dst += kBlockBytes;
        }
        for (const uint8_t* table : {sp, op}) {
          if (table == nullptr) continue;
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const int64_t row = p * kLanes + lane;
            if (row < n)
              std::memcpy(dst + lane * scale_size, table + (row * groups + g) * scale_size,
                          scale_size);
          }
          dst += kLanes * scale_size;
        }
      }
    }
  });
  return w;
}

std::vector<c10::optional<at::Tensor>> unpack_quantized_weight(const QuantizedWeight& w) {
  TORCH_CHECK(w.data.defined(), "unpack_quantized_weight: the weight is empty");
  const int64_t n = w.out_features, k = w.in_features, groups = k / w.group_size;
  const int64_t features = block_features(w.bits);
  const int64_t blocks_per_group = w.group_size / features, stride = w.data.size(1);
  const auto scale_type = w.float_scales ? at::kFloat : at::kHalf;
  auto values = at::empty({n, k}, w.data.options());
  auto scales = at::empty({n, groups}, w.data.options().dtype(scale_type));
  auto offsets = w.asymmetric ? at::empty({n, groups}, scales.options()) : at::Tensor();
  const auto* in = w.data.data_ptr<uint8_t>();
  auto* vp = values.data_ptr<uint8_t>();
  auto* sp = static_cast<uint8_t*>(scales.data_ptr());
  auto* op = w.asymmetric ? static_cast<uint8_t*>(offsets.data_ptr()) : nullptr;
  const int64_t scale_size = scales.element_size();
  const int64_t panels = w.data.size(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* src = in + p * stride;
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < blocks_per_group; ++i) {
          const int64_t k0 = (g * blocks_per_group + i) * features;
          for (int64_t lane = 0; lane < kLanes && p * kLanes + lane < n; ++lane) {
            uint8_t* dst = vp + (p * kLanes + lane) * k + k0;
            for (int64_t j = 0; j < features / 2; ++j)
              for (int64_t e = 0; e < 2; ++e) {
                const int64_t t = 2 * lane + e;
                if (w.bits == 8)
                  dst[2 * j + e] = static_cast<uint8_t>(static_cast<int8_t>(src[32 * j + t]) + 128);
                else if (j < 8)
                  dst[2 * j + e] = src[32 * j + t] & 0x0F;
                else
                  dst[2 * j + e] = src[32 * (j - 8) + t] >> 4;
              }
          }
          src += kBlockBytes;
        }
        for (uint8_t* table : {sp, op}) {
          if (table == nullptr) continue;
          for (int64_t lane = 0; lane < kLanes && p * kLanes + lane < n; ++lane)
            std::memcpy(table + ((p * kLanes + lane) * groups + g) * scale_size,
                        src + lane * scale_size, scale_size);
          src += kLanes * scale_size;
        }
      }
    }
  });
  return {values, scales, w.asymmetric ? c10::optional<at::Tensor>(offsets) : c10::nullopt};
}

void dequantize_rows(at::Tensor out, const QuantizedWeight& w, at::Tensor ids) {
  TORCH_CHECK(w.data.defined(), "dequantize_rows: the weight is empty");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be 1-d int64");
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) &&
                  out.size(1) == w.in_features,
              "out must be (len(ids), ", w.in_features, ") bfloat16 or float32, contiguous");
  const int64_t k = w.in_features, groups = k / w.group_size, stride = w.data.size(1);
  const int64_t features = block_features(w.bits);
  const int64_t blocks_per_group = w.group_size / features;
  const int64_t scale_size = w.float_scales ? 4 : 2;
  const auto ids_c = ids.contiguous();
  const int64_t* idp = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < w.out_features, "dequantize_rows: row ", idp[i],
                " is out of range [0, ", w.out_features, ")");
  const auto* data = w.data.data_ptr<uint8_t>();
  auto scale_at = [&](const uint8_t* p, int64_t lane) {
    if (w.float_scales) {
      float f;
      std::memcpy(&f, p + 4 * lane, 4);
      return f;
    }
    c10::Half h;
    std::memcpy(&h, p + 2 * lane, 2);
    return static_cast<float>(h);
  };
  LOOM_DISPATCH(out.scalar_type(), "dequantize_rows", [&] {
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, ids.size(0), 1, [&](int64_t begin, int64_t end) {
      float row[32];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t lane = idp[i] % kLanes;
        const uint8_t* src = data + (idp[i] / kLanes) * stride;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* scales = src + blocks_per_group * kBlockBytes;
          const float d = scale_at(scales, lane);
          const float m = w.asymmetric ? scale_at(scales + kLanes * scale_size, lane) : 0.f;
          for (int64_t b = 0; b < blocks_per_group; ++b, src += kBlockBytes) {
            for (int64_t j = 0; j < features / 2; ++j)
              for (int64_t e = 0; e < 2; ++e) {
                const int64_t t = 2 * lane + e;
                float q;
                if (w.bits == 8)  // stored q - 128
                  q = static_cast<float>(static_cast<int8_t>(src[32 * j + t])) +
                      (w.asymmetric ? 128.f : 0.f);
                else if (j < 8)
                  q = src[32 * j + t] & 0x0F;
                else
                  q = src[32 * (j - 8) + t] >> 4;
                if (w.bits == 4 && !w.asymmetric) q -= 8.f;
                // as QuantizedTensor.dequantize: d * (q - z), or d * q + m
                row[2 * j + e] = w.asymmetric ? d * q + m : d * q;
              }
            scalar_t* dst = op + i * k + (g * blocks_per_group + b) * features;
            for (int64_t c = 0; c < features; ++c) dst[c] = from_float<scalar_t>(row[c]);
          }
          src += kLanes * scale_size * (w.asymmetric ? 2 : 1);
        }
      }
    });
  });
}

void quantized_linear(at::Tensor out, at::Tensor x, const QuantizedWeight& weight,
                      c10::optional<at::Tensor> bias) {
  TORCH_CHECK(LOOM_HAVE_QUANT_GEMM, "quantized_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(weight.data.defined(), "quantized_linear: the weight is empty");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1 && x.stride(0) % 2 == 0,
              "x must be a 2-d bfloat16 CPU tensor, last dim contiguous, rows 4-byte aligned");
  TORCH_CHECK(x.size(1) == weight.in_features, "x has ", x.size(1), " features, the weight ",
              weight.in_features);
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == weight.out_features,
              "out must be (rows of x, ", weight.out_features,
              ") bfloat16 or float32, last dim contiguous");
  const int64_t rows = x.size(0), n = weight.out_features;
  const int64_t panels = weight.data.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " entries");
    bias_f = at::zeros({panels * kLanes}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  if (rows == 0) return;
#if LOOM_HAVE_QUANT_GEMM
  const int64_t groups = weight.in_features / weight.group_size;
  auto xsum = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const auto* xp = x.data_ptr<c10::BFloat16>();
  group_sums(xp, x.stride(0), rows, weight.in_features, weight.group_size,
             xsum.data_ptr<float>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat)
    dispatch_gemm(weight, xp, x.stride(0), xsum.data_ptr<float>(), rows, bp,
                  out.data_ptr<float>(), out.stride(0));
  else
    dispatch_gemm(weight, xp, x.stride(0), xsum.data_ptr<float>(), rows, bp,
                  out.data_ptr<c10::BFloat16>(), out.stride(0));
#endif
}

}  // namespace loom
