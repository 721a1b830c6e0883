// y = x W^T (+ bias) for weight-only quantized W (4-, 5-, 6- or 8-bit values in groups
// with float16/float32 scales, or the K-quants' two-level ones) and bfloat16 x, on CPUs
// with AVX512-BF16; on CPUs with AVX2, FMA and F16C only, the same layout read as int16
// and multiplied by x rounded to int16 per block of 32 features (namespace avx2, near
// the end), as every row count is on AVX-512 CPUs with VNNI (namespace int16_stream,
// last) while batch invariance is on (the default, common.h): the same integers and
// the same float epilogue at every row count, so a row's outputs do not depend on the
// other rows of its call.
//
// One kernel for every format loom keeps quantized (quant_gemm.h): GGUF's Q8_0, Q4_0,
// Q4_1, Q5_0, Q4_K, Q5_K and Q6_K and loom's wint8 and wint4 all read as w = d * q + m
// per group, with the offset m stored (asymmetric) or fixed at -d * 2^(bits-1)
// (symmetric). The bf16 path below (CPUs without VNNI, and 9 rows or more with batch
// invariance off), per group g of each output row, with bfloat16 x as it comes:
//
//     y[n] += d[n,g] * S[n,g] + m[n,g] * X[g],   S = sum_{k in g} q'[n,k] x[k],
//                                                X = sum_{k in g} x[k]
//
// where q' is q as a bfloat16 integer, exact: 4-, 5- and 6-bit values decode to
// 128 + q (or all three to q - 2^(bits-1), "signed", where that measured
// faster), 8-bit ones are stored q - 128 and converted through float32;
// the bias comes back with X. S comes from vdpbf16ps: every product exact, float32 sums.
// So the result differs from dequantize-then-matmul in float32 only by float32
// rounding: no activation is quantized. (The integer paths round x to int16 with a
// power-of-two step per block of 32, as the AVX2 kernel does:
// exact for every value within 2^8 of the block's largest, within half a step, 2^-15
// of the largest's power of two, for the rest; beside SmolLM2's outliers of 3,000 a
// value near 1 moves by up to 1/16 where bf16 holds it to 1/256. On the Zen 3 VM,
// where every row takes that rounding, the default file's perplexity was within 0.14%
// of its float32 evaluation and its top-1 agreement 99.4%, benchmarks/quantized.md.)
// (The first version quantized x per block of 32
// to int8 for VNNI dot products, as llama.cpp does: an error of up to half a step, 1/254
// of the block's largest |x|, on every input; SmolLM2's MLP inputs reach 3,000 in a few
// channels, which wipes out the rest of their blocks. Its error on the default model's
// first layer was 0.2-0.8% of each linear's largest output; this kernel's is float32
// rounding.)
//
// The K-quants keep their two-level scales (`two_level`): per group of 16 or 32 a 6- or
// 8-bit integer scale (and offset), per super-block of 256 features a float16 factor for
// each; d = float(super) * float(sub) in float32 is exact (11- times 8-bit significands),
// the very value gguf.quants multiplies the values by. So every format is held at about
// its file's size (bits per weight, file -> held; rows padded to panels of 16):
//
//     Q4_0 4.5 -> 4.5   Q4_1 5 -> 5       Q8_0 8.5 -> 8.5   Q5_0 5.5 -> 5.5
//     Q4_K 4.5 -> 4.625 Q5_K 5.5 -> 5.625 Q6_K 6.5625 -> 6.5625
//
// (before: the two-level scales multiplied out into float32, and 5- and 6-bit values
// held in 8 bits: Q4_K 6, Q5_K 10, Q6_K 10, Q5_0 8.5.)
//
// (On CPUs with AVX512-VNNI every row count takes int16_stream instead, 1 to 8 rows with
// batch invariance off; what follows is the bf16 path, theirs from 9 rows then, and
// every row's on a CPU without VNNI.)
// One row streams each weight byte once and unpacks it in registers (a block of 32
// features of 16 outputs: 4-bit 8 loads, 56 unpacking instructions, 16 vdpbf16ps);
// so do up to 12 rows of 4-bit values and 24 of wider ones, each block of up to 6 rows
// unpacking the panel again (stream_rows). More rows, without the tiles, run 4 panels
// at a time over a chunk of them unpacked into L1 (rows_times_quad), so the unpacking
// is paid once per chunk, not per 6 rows (wint8's whole-row groups a slice of a row at
// a time; large asymmetric or two-level groups unpack each panel once into a thread's
// buffer, in L2, instead). On the AMX tiles, up to 32 rows (one
// block) of 4-, 5- or 6-bit values unpack each panel 256 features at a time into L1,
// each chunk right before its tile products.
// No dequantized copy of the weights is kept anywhere.
//
// Layout (pack_quantized_weight, Layout below): panels of 16 output rows. "Pair vector"
// j holds in word 2i + c feature 2j + c of row i (the two bf16 a vdpbf16ps lane
// multiplies). Blocks of 16 rows:
//   4-bit (256 bytes, 32 features): 16 pair vectors as 8 chunks of 32 bytes, chunk c's
//     byte t holding word t of vector c in its low nibble and of vector c + 8 in its
//     high one.
//   5-bit (320 bytes, 32 features): the 4-bit block of the low 4 bits, then a plane of
//     32 little-endian words: bit j of word t is bit 4 of word t of vector j.
//   6-bit (192 bytes, 16 features): 8 pair vectors, the low 4 bits as 4 chunks (vectors
//     c and c + 4), then a plane of 32 words: bits 2j, 2j + 1 of word t are bits 4-5 of
//     word t of vector j.
//   8-bit (256 bytes, 16 features): 8 pair vectors of 32 int8 bytes, q - 128, in word
//     order (so an 8-bit group may be 16 features).
// In a panel, one-level scales: group after group, its blocks, then 16 scales, then 16
// offsets if asymmetric. Two-level: super-block after super-block (256 features): 16
// float16 super scales, 16 super offsets if asymmetric, then the int8 sub-scales of its
// groups (16 per group), their int8 sub-offsets if asymmetric, then the groups' blocks.

#include "quant_gemm.h"

#include "amx.h"
#include "bf16_gemm.h"
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LOOM_HAVE_QUANT_GEMM 1
#else
#define LOOM_HAVE_QUANT_GEMM 0
#endif
// The AVX2 kernel (namespace avx2 below): CPUs without AVX512-BF16, and any AVX-512 one
// under set_isa("generic").
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOOM_HAVE_QUANT_GEMM_AVX2 1
#else
#define LOOM_HAVE_QUANT_GEMM_AVX2 0
#endif

// AVX-512 with VNNI: int16 products (int16_stream below), every row count or 1-8 rows.
#if LOOM_HAVE_QUANT_GEMM && LOOM_HAVE_QUANT_GEMM_AVX2 && defined(__AVX512VNNI__)
#define LOOM_HAVE_INT16_STREAM 1
#else
#define LOOM_HAVE_INT16_STREAM 0
#endif

namespace loom {
namespace {

constexpr int64_t kLanes = 16;       // output rows per panel: one float32 vector
constexpr int64_t kSuperBlock = 256; // features per two-level super-block (the K-quants')
constexpr int64_t kRowBlock = 6;     // rows per micro-kernel call
constexpr int64_t kStreamBlock = 8;  // rows per micro-kernel call unpacking in registers
constexpr int64_t kMaxRowChunk = 96;
// Bytes ahead of the block being read that a streaming row (no unpacked panel) asks the
// cache for, into L2 (`prefetch`). The hardware prefetcher alone left one thread at ~5
// GB/s from memory (the default model's Q8_0 LM head at batch 1: 2.95 ms for 30 MB on 2
// threads); 4-8 KB ahead, into L1, gave 1.8 ms (benchmarks/quantized.md, 2026-12-02).
// Into L2 rather than L1: a 1B model's matmuls at one row on the 2-core Intel AMX VM,
// 16 layers' weights from memory, wint8 53 -> 40 ms a step, Q8_0 50 -> 41, Q4_0 28 ->
// 23 (8, 16 and 64 KB ahead alike into L2; into L1, 64 KB ahead 49, 51, 27); 4-bit
// rows from 4 on, bound by their instructions, unchanged. 16 KB stays within an L1 for
// CPUs whose hints fill it too (2026-12-04).
constexpr int64_t kPrefetch = 16 * 1024;

// Input features and bytes per block of 16 rows (see the layout above).
constexpr int64_t block_features(int64_t bits) { return bits == 4 || bits == 5 ? 32 : 16; }
constexpr int64_t block_bytes(int64_t bits) {
  return bits == 5 ? 320 : bits == 6 ? 192 : 256;
}

// Where a panel's parts lie. A "unit" is what repeats: one group (one-level scales,
// after its blocks) or one super-block (two-level: its scales before its groups' blocks).
struct Layout {
  int64_t bits = 0, groups = 0, blocks_per_group = 0;
  bool asymmetric = false, two_level = false;
  int64_t scale_size = 0;       // bytes per one-level scale (2 or 4); 1 (int8) two-level
  int64_t group_values = 0;     // bytes of a group's blocks
  int64_t groups_per_unit = 1;
  int64_t header = 0;           // bytes before a unit's blocks
  int64_t unit_bytes = 0;

  Layout(int64_t bits_, int64_t k, int64_t group_size, bool asym, bool float_scales,
         bool two)
      : bits(bits_), groups(k / group_size), blocks_per_group(group_size / block_features(bits_)),
        asymmetric(asym), two_level(two) {
    const int64_t tables = asym ? 2 : 1;
    group_values = blocks_per_group * block_bytes(bits);
    if (two_level) {
      scale_size = 1;
      groups_per_unit = kSuperBlock / group_size;
      header = tables * (kLanes * 2 + groups_per_unit * kLanes);
      unit_bytes = header + groups_per_unit * group_values;
    } else {
      scale_size = float_scales ? 4 : 2;
      unit_bytes = group_values + tables * kLanes * scale_size;
    }
  }
  explicit Layout(const QuantizedWeight& w)
      : Layout(w.bits, w.in_features, w.group_size, w.asymmetric, w.float_scales, w.two_level) {}

  int64_t panel_bytes() const { return groups / groups_per_unit * unit_bytes; }
  const uint8_t* unit(const uint8_t* panel, int64_t g) const {
    return panel + g / groups_per_unit * unit_bytes;
  }
  // group g's first block
  const uint8_t* values(const uint8_t* panel, int64_t g) const {
    return unit(panel, g) + header + g % groups_per_unit * group_values;
  }
  // group g's 16 scales (one-level: its d, then its m if asymmetric; two-level: its
  // int8 sub-scales) and sub-offsets (two-level, asymmetric)
  const uint8_t* scales(const uint8_t* panel, int64_t g) const {
    if (!two_level) return unit(panel, g) + group_values;
    return unit(panel, g) + super_bytes() + g % groups_per_unit * kLanes;
  }
  const uint8_t* sub_offsets(const uint8_t* panel, int64_t g) const {
    return scales(panel, g) + groups_per_unit * kLanes;
  }
  // two-level: 16 float16 super scales, then 16 super offsets if asymmetric
  int64_t super_bytes() const { return kLanes * 2 * (asymmetric ? 2 : 1); }
};

// xsum + offset, or null where no path reads the sums (run_gemm's `sums`).
inline const float* offset_sums(const float* xsum, int64_t offset) {
  return xsum ? xsum + offset : nullptr;
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

// The value q in [0, 2^bits) of feature f (of the block's block_features) of row `lane`
// in the block at p, and its inverse for the packing: the layout above, one value at a
// time (packing, unpacking, dequantize_rows).
uint32_t block_value(const uint8_t* p, int64_t bits, int64_t lane, int64_t f) {
  const int64_t j = f / 2, t = 2 * lane + f % 2;
  auto plane_word = [&](int64_t at) { return static_cast<uint32_t>(p[at + 2 * t] | (p[at + 2 * t + 1] << 8)); };
  switch (bits) {
    case 4: return j < 8 ? p[32 * j + t] & 0x0F : p[32 * (j - 8) + t] >> 4;
    case 5: {
      const uint32_t low = j < 8 ? p[32 * j + t] & 0x0F : p[32 * (j - 8) + t] >> 4;
      return low | (((plane_word(256) >> j) & 1) << 4);
    }
    case 6: {
      const uint32_t low = j < 4 ? p[32 * j + t] & 0x0F : p[32 * (j - 4) + t] >> 4;
      return low | (((plane_word(128) >> (2 * j)) & 3) << 4);
    }
    default: return static_cast<uint8_t>(p[32 * j + t] ^ 0x80);  // stored q - 128
  }
}

void set_block_value(uint8_t* p, int64_t bits, int64_t lane, int64_t f, uint32_t q) {
  const int64_t j = f / 2, t = 2 * lane + f % 2;
  auto or_plane = [&](int64_t at, uint32_t bits_) {
    p[at + 2 * t] |= static_cast<uint8_t>(bits_);
    p[at + 2 * t + 1] |= static_cast<uint8_t>(bits_ >> 8);
  };
  const int64_t half = bits == 6 ? 4 : 8;  // vectors per nibble half of the chunks
  if (bits != 8) {
    const uint8_t low = q & 0x0F;
    if (j < half)
      p[32 * j + t] |= low;
    else
      p[32 * (j - half) + t] |= static_cast<uint8_t>(low << 4);
  }
  if (bits == 5) or_plane(256, ((q >> 4) & 1) << j);
  if (bits == 6) or_plane(128, ((q >> 4) & 3) << (2 * j));
  if (bits == 8) p[32 * j + t] = static_cast<uint8_t>(q ^ 0x80);
}

template <typename T>
struct Tag {
  using type = T;
};

// f(bits, asymmetric, Tag<scale type>), each a compile-time constant, for w's format:
// the formats that exist, and only those (each combination is ~12 micro-kernels in the
// AVX-512 kernel): Q4_1/wint4, Q4_0, Q8_0, wint8, Q4_K, Q5_K, Q5_0, Q6_K.
template <typename F>
void with_format(const QuantizedWeight& w, F&& f) {
  using std::integral_constant;
  const std::true_type asym;
  const std::false_type sym;
  const bool half = !w.float_scales && !w.two_level, single = w.float_scales;
  if (w.bits == 4 && w.asymmetric && half) return f(integral_constant<int, 4>{}, asym, Tag<c10::Half>{});
  if (w.bits == 4 && !w.asymmetric && half) return f(integral_constant<int, 4>{}, sym, Tag<c10::Half>{});
  if (w.bits == 8 && !w.asymmetric && half) return f(integral_constant<int, 8>{}, sym, Tag<c10::Half>{});
  if (w.bits == 8 && !w.asymmetric && single) return f(integral_constant<int, 8>{}, sym, Tag<float>{});
  if (w.bits == 4 && w.asymmetric && w.two_level) return f(integral_constant<int, 4>{}, asym, Tag<int8_t>{});
  if (w.bits == 5 && w.asymmetric && w.two_level) return f(integral_constant<int, 5>{}, asym, Tag<int8_t>{});
  if (w.bits == 5 && !w.asymmetric && half) return f(integral_constant<int, 5>{}, sym, Tag<c10::Half>{});
  if (w.bits == 6 && !w.asymmetric && w.two_level) return f(integral_constant<int, 6>{}, sym, Tag<int8_t>{});
  TORCH_CHECK(false, "quantized_linear: no kernel for ", w.bits, "-bit ",
              w.asymmetric ? "asymmetric" : "symmetric", " weights with ",
              w.two_level ? "two-level" : w.float_scales ? "float32" : "float16", " scales");
}

#if LOOM_HAVE_QUANT_GEMM || LOOM_HAVE_QUANT_GEMM_AVX2
// (the AVX2 kernel's streaming rows take it too: a build for CPUs without AVX-512)
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}
#endif

#if LOOM_HAVE_QUANT_GEMM

// f(integral_constant<int, 0>) ... f(integral_constant<int, N - 1>): an unrolled loop
// whose index is a constant (register indices, shift counts).
template <typename F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unrolled(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

// f(integral_constant<int, n>) for a count n in [1, MAX] known only at run time: a
// micro-kernel's block of rows as a template argument.
template <int MAX, typename F>
inline void with_rows(int64_t n, F&& f) {
  unrolled<MAX>([&](auto i) {
    constexpr int kRows = decltype(i)::value + 1;
    if (n == kRows) f(std::integral_constant<int, kRows>{});
  });
}

template <typename ScaleT>
inline __m512 load_scales(const uint8_t* p) {
  if constexpr (std::is_same_v<ScaleT, float>)
    return _mm512_loadu_ps(p);
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 int8x16_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Group s of a unit's d and (asymmetric) m for the 16 rows (see PanelWalk).
template <bool ASYM, typename ScaleT>
inline void unit_scales(const Layout& layout, const uint8_t* unit, int64_t s, __m512& d,
                        __m512& m) {
  if constexpr (std::is_same_v<ScaleT, int8_t>) {
    const uint8_t* sub = unit + layout.super_bytes() + s * kLanes;
    d = _mm512_mul_ps(load_scales<c10::Half>(unit), int8x16_to_ps(sub));
    if constexpr (ASYM)
      m = _mm512_mul_ps(load_scales<c10::Half>(unit + 2 * kLanes),
                        int8x16_to_ps(sub + layout.groups_per_unit * kLanes));
  } else {
    const uint8_t* p = unit + layout.group_values;
    d = load_scales<ScaleT>(p);
    if constexpr (ASYM) m = load_scales<ScaleT>(p + kLanes * sizeof(ScaleT));
  }
}

// A panel, group after group, as the kernels read it: each group's blocks and its d and
// (asymmetric) m for the 16 rows. ScaleT int8_t: two-level, d = super scale x sub-scale
// and m = super offset x sub-offset, each product exact in float32, the super-block's
// factors converted once per super-block. The walk is all pointer steps, no branch on
// the layout: the group's fixed costs are a batch-1 row's margin (a division and a
// branch per group cost one-level formats 15-20% at batch 1 from L3).
template <bool ASYM, typename ScaleT>
struct PanelWalk {
  static constexpr bool kTwoLevel = std::is_same_v<ScaleT, int8_t>;
  const uint8_t* unit;  // this group's unit: its group (one-level), its super-block
  int64_t in_unit = 0;  // two-level: the group's index in its super-block
  __m512 super_d, super_m;

  const uint8_t* values(const Layout& layout) const {
    if constexpr (kTwoLevel) return unit + layout.header + in_unit * layout.group_values;
    return unit;
  }
  void scales(const Layout& layout, __m512& d, __m512& m) {
    if constexpr (kTwoLevel) {
      if (in_unit == 0) {
        super_d = load_scales<c10::Half>(unit);
        if constexpr (ASYM) super_m = load_scales<c10::Half>(unit + 2 * kLanes);
      }
      const uint8_t* s = unit + layout.super_bytes() + in_unit * kLanes;
      d = _mm512_mul_ps(super_d, int8x16_to_ps(s));
      if constexpr (ASYM)
        m = _mm512_mul_ps(super_m, int8x16_to_ps(s + layout.groups_per_unit * kLanes));
    } else {
      const uint8_t* s = unit + layout.group_values;
      d = load_scales<ScaleT>(s);
      if constexpr (ASYM) m = load_scales<ScaleT>(s + kLanes * sizeof(ScaleT));
    }
  }
  void next(const Layout& layout) {
    if constexpr (kTwoLevel) {
      if (++in_unit < layout.groups_per_unit) return;
      in_unit = 0;
    }
    unit += layout.unit_bytes;
  }
};

// A 4-bit chunk's 32 bytes -> its two pair vectors as bf16 128 + q (exact): each byte
// widened to a word and a nibble put into mantissa bits 0-3 of bf16 128.0 (0x4300, whose
// mantissa step is 1): the low one masked in by one vpternlog, the high one shifted
// down and or-ed in. Four instructions for 64 values. (16 + q, the nibble shifted into
// bits 3-6 of 16.0, took five: one more shift. On the Zen 4 VM, one thread, a 1B
// gate/up's shape in L2, 128 + q streamed 30 GB/s where 16 + q streamed 26, in a
// standalone loop; the larger bias costs three bits of the float32 sums' rounding,
// kernel_error_bound's 2^8.) The 128 is taken back with the group's sum of x.
inline void nibbles_to_bf16(const uint8_t* p, __m512i& low, __m512i& high) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i nibble = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  low = _mm512_ternarylogic_epi32(v, nibble, bias, 0xEA);  // (a & b) | c
  high = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);  // a byte's high nibble alone
}

// A 4-bit chunk's 32 bytes -> its two pair vectors as bf16 q - 8 (exact), by a table
// lookup: vpermw reads the low 5 bits of each word, so the low nibble indexes a table
// of 16 entries written twice, and the high one, shifted down, its first half. Four
// instructions for 64 values, and the values come out signed: a group's sums need no
// correction by its sum of x (nibbles_to_bf16 gives 128 + q, whose bias of 136 costs a
// broadcast and a subtraction per row and panel and group; with 6 rows of 4 panels on
// a group of 32, dropping it took the wide kernel to 0.92-0.94 of its time at 32 rows,
// benchmarks/quantized.md). The wide kernel's unpacking uses it; micro_kernel's
// in-register decoding measured no faster with it, and keeps nibbles_to_bf16.
inline void nibbles_to_signed_bf16(const uint8_t* p, __m512i& low, __m512i& high) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // bf16 of -8 ... 7, twice
  const __m512i table = _mm512_set_epi16(
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
      0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
      0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100);
  low = _mm512_permutexvar_epi16(v, table);
  high = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
}

// Shift each word left by S (right by -S).
template <int S>
inline __m512i shift_words(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
}

// 5- and 6-bit: chunk C's 32 bytes of low nibbles and the block's plane -> pair vectors
// C and C + H (H = 8 at 5 bits, 4 at 6) as bf16 128 + q, exact (0x4300 is 128.0, whose
// mantissa step is 1: q in mantissa bits 0-6). The plane's bits for vector j shifted to
// bits 4 (-5) and masked in onto 0x4300 (one vpternlog), the nibble selected into bits
// 0-3 (another): eight instructions for two vectors where 4 bits take five.
template <int BITS, int C>
inline void packed_to_bf16(const uint8_t* p, __m512i plane, __m512i& low, __m512i& high) {
  constexpr int kPlaneBits = BITS - 4, kHalf = BITS == 5 ? 8 : 4;
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i high_mask = _mm512_set1_epi16(BITS == 5 ? 0x10 : 0x30);
  const __m512i bias = _mm512_set1_epi16(0x4300), nibble = _mm512_set1_epi16(0x0F);
  // vector j's plane bits at kPlaneBits * j -> 4
  const __m512i h0 = _mm512_ternarylogic_epi32(shift_words<4 - kPlaneBits * C>(plane),
                                               high_mask, bias, 0xEA);  // (a & b) | c
  const __m512i h1 = _mm512_ternarylogic_epi32(
      shift_words<4 - kPlaneBits * (C + kHalf)>(plane), high_mask, bias, 0xEA);
  low = _mm512_ternarylogic_epi32(v, h0, nibble, 0xE4);  // c ? a : b, bitwise
  high = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), h1, nibble, 0xE4);
}

// 5- and 6-bit, signed: chunk C's two pair vectors as bf16 q - 2^(BITS-1), exact, by a
// table lookup as nibbles_to_signed_bf16: the nibble selected into bits 0-3 of the
// plane's bits for the vector shifted to bit 4 (one vpternlog; the bits above are left
// as they come), then vpermw (5 bits of index, one table) or vpermt2w (6 bits, two
// tables), which read only the low bits of each word. As many instructions as
// packed_to_bf16, and a symmetric group's sums need no correction by its sum of x.
template <int BITS, int C>
inline void packed_to_signed_bf16(const uint8_t* p, __m512i plane, __m512i& low, __m512i& high) {
  constexpr int kPlaneBits = BITS - 4, kHalf = BITS == 5 ? 8 : 4;
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  const __m512i i0 = _mm512_ternarylogic_epi32(
      v, shift_words<4 - kPlaneBits * C>(plane), nibble, 0xE4);  // c ? a : b, bitwise
  const __m512i i1 = _mm512_ternarylogic_epi32(
      _mm512_srli_epi16(v, 4), shift_words<4 - kPlaneBits * (C + kHalf)>(plane), nibble, 0xE4);
  // bf16 of q - 32 for q in [0, 64) (6-bit), and its half from 16 (-16 ... 15, 5-bit)
  alignas(64) static constexpr uint16_t kTable[64] = {
      0xC200, 0xC1F8, 0xC1F0, 0xC1E8, 0xC1E0, 0xC1D8, 0xC1D0, 0xC1C8, 0xC1C0, 0xC1B8, 0xC1B0,
      0xC1A8, 0xC1A0, 0xC198, 0xC190, 0xC188, 0xC180, 0xC170, 0xC160, 0xC150, 0xC140, 0xC130,
      0xC120, 0xC110, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000,
      0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
      0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198, 0x41A0, 0x41A8, 0x41B0,
      0x41B8, 0x41C0, 0x41C8, 0x41D0, 0x41D8, 0x41E0, 0x41E8, 0x41F0, 0x41F8};
  if constexpr (BITS == 5) {
    const __m512i table = _mm512_load_si512(kTable + 16);
    low = _mm512_permutexvar_epi16(i0, table);
    high = _mm512_permutexvar_epi16(i1, table);
  } else {
    const __m512i lo = _mm512_load_si512(kTable), hi = _mm512_load_si512(kTable + 32);
    low = _mm512_permutex2var_epi16(lo, i0, hi);
    high = _mm512_permutex2var_epi16(lo, i1, hi);
  }
}

// The bias each width's decoding adds to q (taken back with the group's sum of x);
// SIGNED: 4-, 5- and 6-bit values decoded as q - 2^(BITS-1) (nibbles_to_signed_bf16,
// packed_to_signed_bf16).
template <int BITS, bool SIGNED = false>
constexpr float kDecodeBias = BITS == 8 ? -128.f
                              : SIGNED  ? -static_cast<float>(1 << (BITS - 1))
                              : 128.f;

// 32 int8 -> 32 bf16 (exact), in order.
inline __m512bh int8x32_to_bf16(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
}

// One block's pair vectors as bf16: f(j, k, vector j) for each, j in [0, block_features
// / 2), k the order they come in (integral_constants both). The micro-kernel sums by k:
// consecutive vectors into different partial sums (chunk c gives vectors c and c + 8,
// which by j would land in one chain and halve the batch-1 throughput).
template <int BITS, bool SIGNED = false, typename F>
inline void decode_block(const uint8_t* p, F&& f) {
  using std::integral_constant;
  if constexpr (BITS == 8) {
    unrolled<8>([&](auto j) { f(j, j, int8x32_to_bf16(p + 32 * j)); });
  } else {
    constexpr int kHalf = BITS == 6 ? 4 : 8;  // chunks: vectors c and c + kHalf
    __m512i plane = _mm512_setzero_si512();
    if constexpr (BITS != 4) plane = _mm512_loadu_si512(p + 32 * kHalf);
    unrolled<kHalf>([&](auto c) {
      constexpr int C = decltype(c)::value;
      __m512i v0, v1;
      if constexpr (BITS == 4 && SIGNED)
        nibbles_to_signed_bf16(p + 32 * C, v0, v1);
      else if constexpr (BITS == 4)
        nibbles_to_bf16(p + 32 * C, v0, v1);
      else if constexpr (SIGNED)
        packed_to_signed_bf16<BITS, C>(p + 32 * C, plane, v0, v1);
      else
        packed_to_bf16<BITS, C>(p + 32 * C, plane, v0, v1);
      f(c, integral_constant<int, 2 * C>{}, (__m512bh)v0);
      f(integral_constant<int, C + kHalf>{}, integral_constant<int, 2 * C + 1>{}, (__m512bh)v1);
    });
  }
}

// Groups [first, first + count) of a panel as bf16 pair vectors, in feature order
// (vector `pair` holds features 2 pair, 2 pair + 1 of the 16 rows): what
// micro_kernel<..., true> reads instead of unpacking each block again for every 6 rows.
template <int BITS, bool SIGNED = false>
void unpack_panel(const Layout& layout, const uint8_t* panel, int64_t first, int64_t count,
                  __m512i* out, int64_t stride = 1) {
  constexpr int kPairs = block_features(BITS) / 2;
  const uint8_t* unit = layout.unit(panel, first);
  for (int64_t g = first, s = first % layout.groups_per_unit; g < first + count; ++g) {
    const uint8_t* p = unit + layout.header + s * layout.group_values;
    if (++s == layout.groups_per_unit) {  // the next group's unit: no division per group
      s = 0;
      unit += layout.unit_bytes;
    }
    for (int64_t i = 0; i < layout.blocks_per_group;
         ++i, out += kPairs * stride, p += block_bytes(BITS))
      decode_block<BITS, SIGNED>(p, [&](auto j, auto, __m512bh w) {
        out[j * stride] = (__m512i)w;
      });
  }
}

// Blocks [first, first + count) of group g of a one-level panel as bf16 pair vectors,
// in feature order: a slice of a group longer than rows_times_quad's chunk.
template <int BITS, bool SIGNED = false>
void unpack_blocks(const Layout& layout, const uint8_t* panel, int64_t g, int64_t first,
                   int64_t count, __m512i* out, int64_t stride) {
  constexpr int kPairs = block_features(BITS) / 2;
  const uint8_t* p = layout.values(panel, g) + first * block_bytes(BITS);
  for (int64_t i = 0; i < count; ++i, out += kPairs * stride, p += block_bytes(BITS))
    decode_block<BITS, SIGNED>(p, [&](auto j, auto, __m512bh w) {
      out[j * stride] = (__m512i)w;
    });
}

// Whether MR rows streaming a panel (micro_kernel, not UNPACKED) decode its values
// signed (packed_to_signed_bf16), dropping each group's correction by the sum of x:
// symmetric 5- and 6-bit values, 0.90-0.97 of the time at 2-16 rows, 1B shapes, one
// thread. Not 6-bit at one row (vpermt2w's two tables: 1.02-1.05), nor asymmetric
// formats, whose offset takes the bias for free (0.96-1.03).
template <int BITS, bool ASYM, int MR>
constexpr bool kStreamSigned = !ASYM && (BITS == 5 || (BITS == 6 && MR >= 2));

// R rows of a panel's sums (+ the panel's 16 biases, or none) to y: `cols` (<= 16)
// outputs a row, float32 or rounded to bf16.
template <int R, typename OutT>
inline void store_rows(const __m512 (&acc)[R], const float* bias, OutT* y, int64_t ldy,
                       int64_t cols) {
  const __mmask16 mask = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 add = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_add_ps(acc[r], add);
    if constexpr (std::is_same_v<OutT, float>)
      _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    else
      _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [0, MR) of x times one panel: `cols` (<= 16) outputs per row. UNPACKED: the
// panel's values come from `unpacked` (unpack_panel), its scales from `panel`.
template <int BITS, bool ASYM, typename ScaleT, int MR, typename OutT, bool UNPACKED>
void micro_kernel(const Layout& layout, const uint8_t* panel, const __m512i* unpacked,
                  const c10::BFloat16* x, int64_t ldx, const float* xsum, const float* bias,
                  OutT* y, int64_t ldy, int64_t cols) {
  constexpr int P = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;  // partial sums per row
  constexpr bool SIGNED = !UNPACKED && kStreamSigned<BITS, ASYM, MR>;
  constexpr int kPairs = block_features(BITS) / 2;  // pair vectors per block
  constexpr int64_t kBytes = block_bytes(BITS);
  const int64_t groups = layout.groups;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  int64_t pair = 0;  // index of the next pair of features
  PanelWalk<ASYM, ScaleT> walk{panel};
  for (int64_t g = 0; g < groups; ++g, walk.next(layout)) {
    // P partial sums per row, so that P * MR vdpbf16ps chains run side by side: with
    // one chain per row, a row alone waits out the instruction's latency at every
    // product (batch 1 streamed 6.6 GB/s per core, bound by that chain, not by memory).
    __m512 part[MR][P];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < P; ++q) part[r][q] = _mm512_setzero_ps();
    const uint8_t* p = walk.values(layout);
    for (int64_t i = 0; i < layout.blocks_per_group; ++i, pair += kPairs, p += kBytes) {
      if constexpr (UNPACKED) {
        for (int j = 0; j < kPairs; ++j) {
          const __m512bh w = (__m512bh)_mm512_load_si512(unpacked + pair + j);
          for (int r = 0; r < MR; ++r)
            part[r][j % P] = _mm512_dpbf16_ps(
                part[r][j % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + j]), w);
        }
      } else {
        for (int l = 0; l < kBytes; l += 64) prefetch(p + kPrefetch + l);
        decode_block<BITS, SIGNED>(p, [&](auto j, auto k, __m512bh w) {
          for (int r = 0; r < MR; ++r)
            part[r][k % P] = _mm512_dpbf16_ps(
                part[r][k % P], (__m512bh)_mm512_set1_epi32(xr[r][pair + j]), w);
        });
      }
    }
    __m512 sum[MR];
    for (int r = 0; r < MR; ++r) {
      for (int q = P / 2; q > 0; q /= 2)  // a fixed tree: the same order every call
        for (int t = 0; t < q; ++t) part[r][t] = _mm512_add_ps(part[r][t], part[r][t + q]);
      sum[r] = part[r][0];
    }
    __m512 d, m;
    walk.scales(layout, d, m);
    if constexpr (ASYM) {
      // w = d q + m = d (q + B) + (m - B d), B the decoding's bias
      m = _mm512_fnmadd_ps(d, _mm512_set1_ps(kDecodeBias<BITS, SIGNED>), m);
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]),
                                 _mm512_fmadd_ps(d, sum[r], acc[r]));
    } else if constexpr (BITS != 8 && !SIGNED) {  // w = d (q - z) = d ((q + B) - (B + z))
      constexpr float kShift = kDecodeBias<BITS> + (1 << (BITS - 1));
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm512_fmadd_ps(
            d, _mm512_sub_ps(sum[r], _mm512_set1_ps(kShift * xsum[r * groups + g])), acc[r]);
    } else {  // stored q - 128 already, or decoded signed
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(d, sum[r], acc[r]);
    }
  }
  store_rows<MR>(acc, bias, y, ldy, cols);
}

#if LOOM_HAVE_AMX
// Rows [0, rows) of x times one panel of 16 outputs on the AMX tiles, from the panel's
// values unpacked to bf16 integers (`unpacked`, pair vector after pair vector: 16 of
// them are one B tile, 64 bytes apart). `unpacked` null (4-, 5- or 6-bit, at most 32
// rows): the panel is unpacked here 256 features at a time into an 8 KB buffer that
// stays in L1, each chunk right before its tile products. (The whole panel unpacked
// first is 32 KB per 1,024 features: written to L2 and read back by the tile loads. Q4_0
// 16,384 x 2,048 at 8 rows, one thread, a standalone copy of this code: 3.5 -> 2.2 ms,
// benchmarks/quantized.md.) Per group, the tiles give S for up to 32 rows
// (C tiles 0-1, A tiles 2-3, B tile 4: the group's pairs, 16 at a time), then S leaves
// the tiles and the group's scales and offsets apply in float32 exactly as the AVX-512
// micro-kernel applies them: only S's float32 sums come in another order.
// (Unrun on the development host, which has no AMX: compile-checked only since the
// 5- and 6-bit layouts and two-level scales.)
template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void amx_rows_times_panel(const Layout& layout, const uint8_t* panel, const __m512i* unpacked,
                          const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t rows,
                          const float* bias, OutT* y, int64_t ldy, int64_t cols,
                          int64_t& configured) {
  const int64_t groups = layout.groups;
  const int64_t group_pairs = layout.blocks_per_group * block_features(BITS) / 2;
  const int64_t step = std::min<int64_t>(group_pairs, 16);  // pairs per tile product
  const int64_t x_stride = ldx * 2;
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
    const float* xs = offset_sums(xsum, r0 * groups);
    PanelWalk<ASYM, ScaleT> walk{panel};
    for (int64_t g = 0; g < groups; ++g, walk.next(layout)) {
      if (!unpacked && g % chunk_groups == 0)
        unpack_panel<BITS>(layout, panel, g, std::min(chunk_groups, groups - g), chunk.data());
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
      __m512 d, offset = _mm512_setzero_ps();
      walk.scales(layout, d, offset);
      if constexpr (ASYM) offset = _mm512_fnmadd_ps(d, _mm512_set1_ps(kDecodeBias<BITS>), offset);
      for (int64_t r = 0; r < m; ++r) {
        const __m512 sum = _mm512_load_ps(sums[r]);
        __m512 a = _mm512_load_ps(acc[r]);
        if constexpr (ASYM)
          a = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[r * groups + g]),
                              _mm512_fmadd_ps(d, sum, a));
        else if constexpr (BITS != 8)
          a = _mm512_fmadd_ps(
              d,
              _mm512_sub_ps(sum, _mm512_set1_ps((kDecodeBias<BITS> + (1 << (BITS - 1))) *
                                                xs[r * groups + g])),
              a);
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

// Without the tiles, up to this many rows stream each panel through the registers,
// every block of rows unpacking it again (micro_kernel): below it, that costs less than
// the wide kernel's round trip through an unpacked chunk and its per-group sums in
// memory. Measured on the Zen 5 VM (no AMX), 1B shapes, 2 threads and 1: 5-, 6- and
// 8-bit values streamed take 0.65-0.8 of the wide kernel's time at 8-24 rows and break
// even at 32; 4-bit ones, whose unpacking is cheapest, gain at 8-12 rows on one thread
// (0.75-0.8) and break even at 8 on two (benchmarks/quantized.md).
template <int BITS>
constexpr int64_t stream_rows() { return BITS == 4 ? 12 : 24; }

template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void rows_times_panel(const Layout& layout, const uint8_t* panel, const c10::BFloat16* x,
                      int64_t ldx, const float* xsum, int64_t rows, const float* bias, OutT* y,
                      int64_t ldy, int64_t cols, bool amx, int64_t& configured) {
  // More rows than stream_rows (or the tiles): unpack the panel once (K / 2 vectors, 32
  // KB per 1,024 features, in L2) and let every block of rows read it, rather than
  // unpack it again per 6 rows (batch 32: 6 unpackings of each weight instead of 1).
  const __m512i* unpacked = nullptr;
  // One block of 4-bit rows on the tiles unpacks by chunks (amx_rows_times_panel); 5-
  // and 6-bit ones, whose decoding is as cheap, too (unmeasured: no AMX here). 8-bit
  // values (their unpacking through float32 costs more than the L2 round trip it saves)
  // measured no faster that way (benchmarks/quantized.md): whole panel first.
  const bool by_chunks = amx && rows <= 32 && BITS != 8;
  if (rows > kRowBlock && !by_chunks && (amx || rows > stream_rows<BITS>())) {
    thread_local std::vector<__m512i> buffer;
    const int64_t vectors = layout.groups * layout.blocks_per_group * block_features(BITS) / 2;
    if (static_cast<int64_t>(buffer.size()) < vectors) buffer.resize(vectors);
    unpack_panel<BITS>(layout, panel, 0, layout.groups, buffer.data());
    unpacked = buffer.data();
  }
#if LOOM_HAVE_AMX
  if (amx) {
    amx_rows_times_panel<BITS, ASYM, ScaleT, OutT>(layout, panel, unpacked, x, ldx, xsum, rows,
                                                   bias, y, ldy, cols, configured);
    return;
  }
#endif
  const int64_t groups = layout.groups;
  // Blocks of up to 8 rows when each unpacks the panel in registers, which 8 rows share
  // (one 8-row block took 0.75-0.96 of two of 4 rows' time at 8 rows, 1B shapes, one
  // thread); up to 6 when they read it unpacked.
  if (unpacked) {
    even_row_blocks(rows, kRowBlock, [&](int64_t r, int64_t mr) {
      with_rows<kRowBlock>(mr, [&](auto m) {
        micro_kernel<BITS, ASYM, ScaleT, decltype(m)::value, OutT, true>(
            layout, panel, unpacked, x + r * ldx, ldx, offset_sums(xsum, r * groups), bias,
            y + r * ldy, ldy, cols);
      });
    });
    return;
  }
  even_row_blocks(rows, kStreamBlock, [&](int64_t r, int64_t mr) {
    with_rows<kStreamBlock>(mr, [&](auto m) {
      micro_kernel<BITS, ASYM, ScaleT, decltype(m)::value, OutT, false>(
          layout, panel, nullptr, x + r * ldx, ldx, offset_sums(xsum, r * groups), bias,
          y + r * ldy, ldy, cols);
    });
  });
}

// Without the tiles, more than one block of rows runs kQuad panels (64 outputs) at a
// time, bf16_gemm.cpp's blocking: 6 rows x 64 outputs of sums in 24 registers, so a
// pair of features costs 4 vector loads and 6 broadcasts for 24 vdpbf16ps (one panel at
// a time: 1 load and 6 broadcasts for 6, and 6 dependent chains that wait out the
// instruction's latency). The panels are unpacked a chunk of ~128 features at a time
// into a 16 KB buffer, the 4 panels' pair vectors interleaved (one 256-byte stretch per
// pair), that stays in L1 while every block of rows reads it (256 features, 32 KB,
// beside 32 rows of x overflowed the 48 KB L1: 128 took 0.85 of the time at 16 and 32
// rows). 4-, 5- and 6-bit values unpack signed (nibbles_to_signed_bf16,
// packed_to_signed_bf16). Per group, the 24 sums
// are scaled into float32 accumulators kept in a thread buffer by a multiply and an
// add, not an FMA: beside the vdpbf16ps stream the FMA measured slower (a standalone
// loop of 6 rows x 4 panels with a group of 16 pairs: 5.6 G vdpbf16ps/s with the FMA,
// 6.7-6.8 with multiply and add, 7.2 with no scaling at all; the one-row micro_kernel
// measured the other way, and keeps its FMA). Measured on the 2-core Zen 5 VM
// (AVX512-BF16, no AMX), a 1B Llama's shapes: see benchmarks/quantized.md.
constexpr int64_t kQuad = 4;                 // panels per wide micro-kernel call
constexpr int64_t kChunkFeatures = 128;      // features unpacked per chunk
constexpr int64_t kWideMaxGroup = 512;  // larger asymmetric or two-level groups stay per panel

// Rows [0, MR) times the chunk's `chunk_groups` groups (starting at group g0) of kQuad
// panels: values from `unpacked` (pair j of panel v at unpacked[kQuad * j + v]), each
// group's d and m' = m - B d (B the decoding's bias; asymmetric) from `scales` (panel
// v's group gi at scales[2 * (v * chunk_groups + gi)], then m'), float32 once per chunk
// (two-level ones multiplied out there, not again for every 6 rows); acc (MR x 64
// floats, row stride 64) accumulates the scaled sums.
template <int BITS, bool ASYM, bool SIGNED, int MR>
void wide_kernel(const __m512i* unpacked, const __m512* scales,
                 int64_t g0, int64_t chunk_groups, int64_t group_pairs,
                 const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t groups,
                 float* acc) {
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  for (int64_t gi = 0; gi < chunk_groups; ++gi) {
    __m512 part[MR][kQuad];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kQuad; ++v) part[r][v] = _mm512_setzero_ps();
    const __m512i* w = unpacked + gi * group_pairs * kQuad;
    const int64_t pair0 = (g0 + gi) * group_pairs;  // x's pair index
    for (int64_t j = 0; j < group_pairs; ++j, w += kQuad) {
      const __m512bh w0 = (__m512bh)_mm512_load_si512(w);
      const __m512bh w1 = (__m512bh)_mm512_load_si512(w + 1);
      const __m512bh w2 = (__m512bh)_mm512_load_si512(w + 2);
      const __m512bh w3 = (__m512bh)_mm512_load_si512(w + 3);
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
      // as micro_kernel: w = d (q + B) + (m - B d), or d ((q + B) - (B + z)), where
      // values come signed (B = -2^(BITS-1) = -z: no correction when symmetric)
      const __m512 d = scales[2 * (v * chunk_groups + gi)];
      const __m512 m = scales[2 * (v * chunk_groups + gi) + 1];
      for (int r = 0; r < MR; ++r) {
        float* a = acc + r * 64 + 16 * v;
        __m512 sum = part[r][v];
        if constexpr (!ASYM && BITS != 8 && !SIGNED)
          sum = _mm512_sub_ps(
              sum, _mm512_set1_ps((kDecodeBias<BITS> + (1 << (BITS - 1))) * xsum[r * groups + g]));
        __m512 out = _mm512_add_ps(_mm512_mul_ps(d, sum), _mm512_load_ps(a));
        if constexpr (ASYM)
          out = _mm512_add_ps(_mm512_mul_ps(m, _mm512_set1_ps(xsum[r * groups + g])), out);
        _mm512_store_ps(a, out);
      }
    }
  }
}

// All `rows` rows (more than stream_rows) times kQuad panels starting at `panel` (`count`
// of them real: a last, partial quad repeats its last panel, whose outputs are not
// written), writing `cols` (<= 64) outputs per row.
template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void rows_times_quad(const Layout& layout, const uint8_t* panel, int64_t stride, int64_t count,
                     const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t rows,
                     const float* bias, OutT* y, int64_t ldy, int64_t cols,
                     bool prefetch_next_quad) {
  const int64_t groups = layout.groups;
  const int64_t group_pairs = layout.blocks_per_group * block_features(BITS) / 2;
  // 4-, 5- and 6-bit values unpack signed, q - 2^(BITS-1): a symmetric group's sums need
  // no correction per row (Q6_K and Q5_0 at 32 and 64 rows, one thread: 0.75-0.85 of
  // the time; asymmetric Q5_K, whose offset takes the bias, 0.93-0.96).
  constexpr bool kSigned = BITS != 8;
  // whole units (super-blocks), so that each chunk's walks start at one
  const int64_t per_unit = layout.groups_per_unit;
  const int64_t chunk_groups =
      (std::max<int64_t>(1, kChunkFeatures / (2 * group_pairs)) + per_unit - 1) / per_unit *
      per_unit;
  const int64_t chunk_pairs = chunk_groups * group_pairs;
  const int64_t chunk_bytes = chunk_groups / per_unit * layout.unit_bytes;
  // A symmetric one-level group longer than a chunk (wint8's whole rows) is taken a
  // slice at a time, each slice's sums scaled by the group's d as it ends: d S1 + d S2
  // for d (S1 + S2), a float32 rounding apart, and the slices stay in L1 (whole rows of
  // 2,048 features unpacked per panel into L2 ran a 1B LM head at 32 rows in 22 ms, Q8_0's
  // groups of 32 in 13).
  constexpr int64_t kBlockPairs = block_features(BITS) / 2;
  const bool sliced = !ASYM && !layout.two_level && group_pairs > kChunkFeatures / 2;
  int64_t slice_pairs = kChunkFeatures / 2 / kBlockPairs * kBlockPairs;
  while (sliced && group_pairs % slice_pairs) slice_pairs -= kBlockPairs;
  const int64_t buffer_pairs = sliced ? slice_pairs : chunk_pairs;
  thread_local std::vector<__m512i> buffer;
  thread_local std::vector<__m512> sums;  // rows x 64 float32 accumulators
  thread_local std::vector<__m512> scales;  // the chunk's d and m' (wide_kernel)
  if (static_cast<int64_t>(buffer.size()) < kQuad * buffer_pairs)
    buffer.resize(kQuad * buffer_pairs);
  if (static_cast<int64_t>(scales.size()) < 2 * kQuad * chunk_groups)
    scales.resize(2 * kQuad * chunk_groups);
  if (static_cast<int64_t>(sums.size()) < rows * kQuad) sums.resize(rows * kQuad);
  float* acc = reinterpret_cast<float*>(sums.data());
  std::fill(acc, acc + rows * 64, 0.f);
  const uint8_t* panels[kQuad];
  const uint8_t* units[kQuad];  // each panel's unit of the chunk's first group
  for (int64_t v = 0; v < kQuad; ++v) units[v] = panels[v] = panel + std::min(v, count - 1) * stride;
  const int64_t per_group = group_pairs / slice_pairs;  // slices, when sliced
  const int64_t slices = sliced ? groups * per_group : 0;
  const int64_t slice_blocks = slice_pairs / kBlockPairs;
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t g = s / per_group, b0 = s % per_group * slice_blocks;
    for (int64_t v = 0; v < kQuad; ++v) {
      unpack_blocks<BITS, kSigned>(layout, panels[v], g, b0, slice_blocks, buffer.data() + v,
                                   kQuad);
      __m512 d, m = _mm512_setzero_ps();
      unit_scales<ASYM, ScaleT>(layout, layout.unit(panels[v], g), 0, d, m);
      scales[2 * v] = d;
      scales[2 * v + 1] = m;
    }
    // the next slice (or the next quad's first), as the chunks below ask for theirs
    const int64_t next_g = (s + 1) / per_group, next_b = (s + 1) % per_group * slice_blocks;
    for (int64_t v = 0; v < kQuad; ++v) {
      if (s + 1 >= slices && !prefetch_next_quad) break;
      const uint8_t* next = s + 1 < slices
                                ? layout.values(panels[v], next_g) + next_b * block_bytes(BITS)
                                : panel + (kQuad + v) * stride;
      for (int64_t l = 0; l < slice_blocks * block_bytes(BITS); l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T0);
    }
    // slice s is "group" s of slice_pairs pairs: x's pairs from s * slice_pairs
    even_row_blocks(rows, kRowBlock, [&](int64_t r, int64_t mr) {
      with_rows<kRowBlock>(mr, [&](auto m) {
        wide_kernel<BITS, ASYM, kSigned, decltype(m)::value>(
            buffer.data(), scales.data(), s, 1, slice_pairs, x + r * ldx, ldx,
            offset_sums(xsum, r * groups), groups, acc + r * 64);
      });
    });
  }
  for (int64_t g0 = 0; g0 < (sliced ? 0 : groups); g0 += chunk_groups) {
    const int64_t gn = std::min(chunk_groups, groups - g0);
    for (int64_t v = 0; v < kQuad; ++v) {
      unpack_panel<BITS, kSigned>(layout, panels[v], g0, gn, buffer.data() + v, kQuad);
      __m512* vs = scales.data() + 2 * v * gn;  // wide_kernel's chunk_groups is gn
      for (int64_t gi = 0; gi < gn; ++gi) {
        const uint8_t* unit = units[v] + gi / per_unit * layout.unit_bytes;
        __m512 d, m = _mm512_setzero_ps();
        unit_scales<ASYM, ScaleT>(layout, unit, gi % per_unit, d, m);
        if constexpr (ASYM) m = _mm512_fnmadd_ps(d, _mm512_set1_ps(kDecodeBias<BITS, kSigned>), m);
        vs[2 * gi] = d;
        vs[2 * gi + 1] = m;
      }
    }
    // The next chunk of each panel (or the next quad's first), asked for now: four
    // streams of 2 KB are too short for the hardware prefetcher, and unpacking them as
    // they come waited on memory (a 1B gate/up at 8 rows, one thread: half the time).
    for (int64_t v = 0; v < kQuad; ++v) {
      const uint8_t* next = g0 + chunk_groups < groups
                                ? panels[v] + (g0 + chunk_groups) / per_unit * layout.unit_bytes
                                : panel + (kQuad + v) * stride;
      if (g0 + chunk_groups >= groups && !prefetch_next_quad) break;
      for (int64_t l = 0; l < chunk_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(next + l), _MM_HINT_T0);
    }
    even_row_blocks(rows, kRowBlock, [&](int64_t r, int64_t mr) {
      with_rows<kRowBlock>(mr, [&](auto m) {
        wide_kernel<BITS, ASYM, kSigned, decltype(m)::value>(
            buffer.data(), scales.data(), g0, gn, group_pairs, x + r * ldx, ldx,
            offset_sums(xsum, r * groups), groups, acc + r * 64);
      });
    });
    for (int64_t v = 0; v < kQuad; ++v) units[v] += chunk_bytes;
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
void run_gemm(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx, int64_t rows,
              const float* bias, OutT* y, int64_t ldy) {
  const Layout layout(w);
  const int64_t n = w.out_features, panels = w.data.size(0), stride = w.data.size(1);
  const int64_t groups = layout.groups;
  const auto* data = w.data.data_ptr<uint8_t>();
  // The tiles take 8 rows or more when a group's pairs fill whole tile products (16 at
  // a time, or Q6_K's 8).
  const int64_t group_pairs = w.group_size / 2;
  const bool amx = rows >= amx::kMinRows && (group_pairs % 16 == 0 || group_pairs == 8) &&
                   bf16_amx_available();
  const int64_t block = amx ? 32 : kRowBlock;
  const int64_t chunks = (rows + kMaxRowChunk - 1) / kMaxRowChunk;
  const int64_t chunk_rows = ((rows + chunks - 1) / chunks + block - 1) / block * block;
  const bool wide = !amx && rows > stream_rows<BITS>() &&
                    (w.group_size <= kWideMaxGroup || (!ASYM && !w.two_level));
  // x's sums per group, where the chosen path reads them: asymmetric offsets, and values
  // decoded with a bias (unsigned): on the tiles, unpacked whole (more rows than
  // stream_rows, not wide), or streamed unsigned (kStreamSigned; a block has one row
  // only when x has). The wide kernel's values come signed and 8-bit ones centred: for
  // symmetric formats there it skips a pass over x and a parallel region per linear (4
  // a layer; 3-7% of a 1B batch-32 step, benchmarks/quantized.md).
  const bool streamed_signed =
      rows == 1 ? kStreamSigned<BITS, ASYM, 1> : kStreamSigned<BITS, ASYM, 2>;
  const bool sums = ASYM || (BITS != 8 && !wide &&
                             (amx || rows > stream_rows<BITS>() || !streamed_signed));
  at::Tensor sums_tensor;
  const float* xsum = nullptr;
  if (sums) {
    sums_tensor = at::empty({rows, groups}, at::TensorOptions().dtype(at::kFloat));
    xsum = sums_tensor.data_ptr<float>();
    group_sums(x, ldx, rows, w.in_features, w.group_size, sums_tensor.data_ptr<float>());
  }
  if (wide) {
    const int64_t quads = (panels + kQuad - 1) / kQuad;
    at::parallel_for(0, chunks * quads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t chunk = item / quads, q = item % quads;
        const int64_t r0 = chunk * chunk_rows, nrows = std::min(chunk_rows, rows - r0);
        if (nrows <= 0) continue;
        const int64_t p = q * kQuad;
        rows_times_quad<BITS, ASYM, ScaleT, OutT>(
            layout, data + p * stride, stride, std::min(kQuad, panels - p),
            x + r0 * ldx, ldx, offset_sums(xsum, r0 * groups), nrows,
            bias ? bias + p * kLanes : nullptr,
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
          layout, data + p * stride, x + r0 * ldx, ldx, offset_sums(xsum, r0 * groups), nrows,
          bias ? bias + p * kLanes : nullptr, y + r0 * ldy + p * kLanes, ldy,
          std::min(kLanes, n - p * kLanes), amx, configured);
    }
#if LOOM_HAVE_AMX
    amx::release(configured);
#endif
  });
}

#endif


#if LOOM_HAVE_QUANT_GEMM_AVX2
// The kernel for CPUs with AVX2, FMA and F16C but not AVX512-BF16 (AMD Zen 2 and 3,
// Intel before Sapphire Rapids' client parts): the same layout and the same arithmetic
// as the AVX-512 kernel, in float32. Per group, S = sum q x over the group's features
// with q a small integer and x a bfloat16 value converted to float32, each product
// exact (at most 8 x 8 significant bits), summed in float32; then y += d S + m X. So it
// differs from dequantize-then-matmul in float32 only by float32 rounding, as the
// AVX-512 kernel does.
//
// A block's pair vector j (features 2j, 2j + 1 of 16 rows, word t = 2 i + c) is read a
// quarter at a time: words 8 qt .. 8 qt + 7, rows 4 qt .. 4 qt + 3, both features, as 8
// float32 lanes; each is multiplied by x's pair (x[2j], x[2j + 1]) repeated four times
// (one vbroadcastsd), so each lane sums one parity of one row, and a vhaddps per 8 rows
// at the group's end adds the two parities.
//   One or two rows of x: the values decoded in registers, each byte read once per
//   call (batch-1 decode is bound by the weight bytes).
//   More rows: a slab of up to 256 features of the panel dequantized into a 16 KB
//   buffer (float32, as dequantize() computes each value: d q is exact, + m rounds
//   once) once, then 2 rows at a time multiply it from L1 (8 sums in registers).
namespace avx2 {

constexpr int64_t kSlabFeatures = 256;

inline __m256 load8_scales_half(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 int8x8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A panel, group after group, by pointer steps (a division per group, as Layout's
// accessors take, cost the AVX-512 kernel 15-20% at batch 1): each group's blocks and
// its d and (asymmetric) m for the 16 rows, lanes 0-7 and 8-15. ScaleT int8_t:
// two-level, d = super scale x sub-scale, m = super offset x sub-offset (exact).
template <bool ASYM, typename ScaleT>
struct GroupWalk {
  static constexpr bool kTwoLevel = std::is_same_v<ScaleT, int8_t>;
  const Layout& layout;
  const uint8_t* unit;  // this group's unit: its group (one-level), its super-block
  int64_t in_unit = 0;  // two-level: the group's index in its super-block

  GroupWalk(const Layout& l, const uint8_t* panel) : layout(l), unit(panel) {}
  const uint8_t* values() const {
    if constexpr (kTwoLevel) return unit + layout.header + in_unit * layout.group_values;
    return unit;
  }
  void scales(__m256 d[2], __m256 m[2]) const {
    if constexpr (kTwoLevel) {
      const uint8_t* sub = unit + layout.super_bytes() + in_unit * kLanes;
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_mul_ps(load8_scales_half(unit + 16 * h), int8x8_to_ps(sub + 8 * h));
        if constexpr (ASYM)
          m[h] = _mm256_mul_ps(load8_scales_half(unit + 2 * kLanes + 16 * h),
                               int8x8_to_ps(sub + layout.groups_per_unit * kLanes + 8 * h));
      }
    } else {
      const uint8_t* s = unit + layout.group_values;
      for (int h = 0; h < 2; ++h) {
        if constexpr (std::is_same_v<ScaleT, float>) {
          d[h] = _mm256_loadu_ps(reinterpret_cast<const float*>(s) + 8 * h);
          if constexpr (ASYM)
            m[h] = _mm256_loadu_ps(reinterpret_cast<const float*>(s) + kLanes + 8 * h);
        } else {
          d[h] = load8_scales_half(s + 16 * h);
          if constexpr (ASYM) m[h] = load8_scales_half(s + 2 * kLanes + 16 * h);
        }
      }
    }
  }
  void next() {
    if constexpr (kTwoLevel) {
      if (++in_unit < layout.groups_per_unit) return;
      in_unit = 0;
    }
    unit += layout.unit_bytes;
  }
};

// The AVX2 kernel multiplies integers: x is quantized per block of 32 features to int16
// with a power-of-two step (quantize_x below), the weights' values are decoded to int16
// words, and vpmaddwd sums two exact products into each int32 lane. The pair layout
// above is what vpmaddwd reads: word 2i + c of a pair vector is feature 2j + c of row i,
// so lane i of vpmaddwd(pair vector, x's pair broadcast) is row i's two products. Per
// span of 32 features (16 where a group is 16: Q6_K, some 8-bit groups) the int32 sums
// are exact, converted once and scaled by d * step (step a power of two: exact):
//
//     y[n] += d[n,g] * step[b] * (S - z X) + m[n,g] * Xf,   S = sum q[n,k] xq[k]
//
// (z the zero point of symmetric 4-, 5- and 6-bit values, X the span's sum of xq, Xf
// its sum of x in float32). The only error besides float32 rounding is x's: xq = x /
// step exactly for every value within 2^8 of its block's largest (bf16 has 8
// significant bits and the step is 2^-14 of the largest's power of two), and within
// half a step, 2^-15 of that largest, for the smaller ones (kernel_error_bound in
// quantization.py). llama.cpp quantizes x to int8 per block of 32: half a step is 1/254
// of the block's largest there. Why integers: the float32 version spent about 4
// micro-ops per 8 weights at one row (decode to int32, convert, broadcast, FMA); the
// int16 one 1.75 (vpmovzxbw, and, shift for 32 weights; vpmaddwd, vpaddd per 16), and
// vpmaddwd does 16 multiply-adds where vfmadd231ps does 8, both 2 a cycle on Zen 3
// (benchmarks/quantized.md, the Zen 3 VM).

constexpr int64_t kXBlock = 32;  // input features per step of x

// x quantized for one call (run_gemm): per row, k int16 values, a step per block of 32
// features, and per span (32 features, or 16 where groups are 16) the sums of the int16
// values (symmetric formats with a zero point, at most 2 rows) and of x in float32
// (asymmetric formats).
struct IntX {
  const int16_t* q = nullptr;     // (rows, k)
  const float* step = nullptr;    // (rows, blocks)
  const int32_t* sums = nullptr;  // (rows, spans) or null
  const float* fsums = nullptr;   // (rows, spans) or null
  int64_t k = 0, blocks = 0, span = 0, spans = 0;
};

// x (rows, k) bf16 -> q (rows, k) int16 and step (rows, ceil(k / 32)): per block of 32
// features, step = 2^(E - 14) for the block's largest |x| in [2^E, 2^(E+1)) and q = x /
// step rounded to nearest even (exact for every x whose exponent is within 8 of E, so
// for every bf16 value within 2^8 of the largest). An all-zero block has step 0; one
// holding an infinity or NaN, step NaN (its outputs come out NaN, as the reference's).
// `sums` (rows, k / span), where not null: each span's sum of q.
void quantize_x(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t k, int16_t* q,
                float* step, int64_t span, int32_t* sums) {
  const int64_t blocks = (k + kXBlock - 1) / kXBlock;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const auto* src = reinterpret_cast<const uint16_t*>(x + r * ldx) + b * kXBlock;
        int16_t* dst = q + r * k + b * kXBlock;
        const int64_t len = std::min(kXBlock, k - b * kXBlock);  // a multiple of 16
        uint16_t top = 0;
        for (int64_t i = 0; i < len; ++i) top = std::max<uint16_t>(top, src[i] & 0x7FFF);
        const int exponent = std::max(top >> 7, 1);  // bf16's biased exponent (subnormals: 1)
        float& s = step[r * blocks + b];
        if (top == 0 || exponent == 255) {
          s = top == 0 ? 0.f : std::numeric_limits<float>::quiet_NaN();
          std::fill(dst, dst + len, int16_t{0});
          continue;
        }
        // 2^(E - 14), E = exponent - 127: from its exponent bits, or a float32 subnormal
        const uint32_t bits = static_cast<uint32_t>(exponent - 14) << 23;
        if (exponent > 14) std::memcpy(&s, &bits, 4); else s = std::ldexp(1.f, exponent - 141);
        if (exponent < 14) {  // 1 / step beyond float32: tiny x, in double
          const double inv = std::ldexp(1.0, 141 - exponent);
          for (int64_t i = 0; i < len; ++i)
            dst[i] = static_cast<int16_t>(std::nearbyint(to_float(x[r * ldx + b * kXBlock + i]) * inv));
          continue;
        }
        // 1 / step = 2^(141 - exponent), in [2^-114, 2^127]: built from its exponent bits
        const __m256 inv = _mm256_castsi256_ps(_mm256_set1_epi32((268 - exponent) << 23));
        for (int64_t i = 0; i < len; i += 16) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
          auto widen = [&](__m128i h) {  // 8 bf16 -> float32, times 1 / step, rounded
            const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            return _mm256_cvtps_epi32(_mm256_mul_ps(f, inv));
          };
          const __m256i packed = _mm256_packs_epi32(widen(_mm256_castsi256_si128(raw)),
                                                    widen(_mm256_extracti128_si256(raw, 1)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                              _mm256_permute4x64_epi64(packed, 0xD8));
        }
      }
      if (sums)
        for (int64_t s = 0; s < k / span; ++s) {
          const int16_t* src = q + r * k + s * span;
          int32_t total = 0;
#pragma omp simd reduction(+ : total)
          for (int64_t i = 0; i < span; ++i) total += src[i];
          sums[r * (k / span) + s] = total;
        }
    }
  });
}

// `bytes` of scratch for one call's quantized x: the calling thread's buffer, kept
// between calls, up to 1 MB (a decode step's calls); a larger prompt chunk's in
// `large`, freed with it.
inline uint8_t* x_scratch(int64_t bytes, std::vector<uint8_t>& large) {
  constexpr int64_t kKept = 1 << 20;
  thread_local std::vector<uint8_t> kept;
  std::vector<uint8_t>& buffer = bytes <= kKept ? kept : large;
  if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(bytes <= kKept ? kKept : bytes);
  return buffer.data();
}

// The zero point a symmetric format's decoded values carry (decode_words gives 4-, 5-
// and 6-bit values as stored, in [0, 2^BITS); 8-bit ones are stored q - 128, signed).
template <int BITS, bool ASYM>
constexpr int32_t zero_point() { return ASYM || BITS == 8 ? 0 : 1 << (BITS - 1); }

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// x's pair (xq[0], xq[1]) in every lane.
inline __m256i pair(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// f(j, h, set, q): the block at p, pair vector j, rows 8h..8h+7, as 16 int16 words
// (word 2i + c: row 8h + i, feature 2j + c), values as stored (zero_point). `set`
// alternates 0, 1 between consecutive calls of one h: callers that sum into two sets
// of registers keep the chains short.
template <int BITS, typename F>
inline void decode_words(const uint8_t* p, F&& f) {
  if constexpr (BITS == 8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) f(j, h, j & 1, _mm256_cvtepi8_epi16(load16(p + 32 * j + 16 * h)));
  } else {
    constexpr int kChunks = BITS == 6 ? 4 : 8;
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    __m256i plane[2];
    if constexpr (BITS != 4)
      for (int h = 0; h < 2; ++h)
        plane[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * kChunks + 32 * h));
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu8_epi16(load16(p + 32 * c + 16 * h));
        __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_srli_epi16(v, 4);
        if constexpr (BITS != 4) {
          constexpr int kHigh = BITS - 4;  // high bits per value in the plane
          const __m256i mask = _mm256_set1_epi16(((1 << kHigh) - 1) << 4);
          // vector j's bits at kHigh * j: shifted to bit 4
          auto high_bits = [&](int at) {
            return _mm256_and_si256(at >= 4 ? _mm256_srli_epi16(plane[h], at - 4)
                                            : _mm256_slli_epi16(plane[h], 4 - at), mask);
          };
          lo = _mm256_or_si256(lo, high_bits(kHigh * c));
          hi = _mm256_or_si256(hi, high_bits(kHigh * (c + kChunks)));
        }
        f(c, h, 0, lo);
        f(c + kChunks, h, 1, hi);
      }
  }
}

template <typename OutT>
inline void store_row(const __m256 y[2], const float* bias, OutT* out, int64_t n) {
  alignas(32) float row[kLanes];
  _mm256_store_ps(row, y[0]);
  _mm256_store_ps(row + 8, y[1]);
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<OutT>(bias ? row[i] + bias[i] : row[i]);
}

// y_h += d_h step (S_h - z X) (+ m_h Xf): one span's int32 sums of one row into its
// outputs, given the row's step for the span, its sum X of x's int16 values (read where
// ZERO != 0) and its float32 sum Xf (read where ASYM).
template <bool ASYM, int32_t ZERO>
inline void add_span(__m256 y[2], const __m256i s[2], const __m256 d[2], const __m256 m[2],
                     float step, int32_t sum, float fsum) {
  const __m256 st = _mm256_set1_ps(step);
  for (int h = 0; h < 2; ++h) {
    __m256i t = s[h];
    if constexpr (ZERO != 0) t = _mm256_sub_epi32(t, _mm256_set1_epi32(ZERO * sum));
    y[h] = _mm256_fmadd_ps(_mm256_mul_ps(d[h], st), _mm256_cvtepi32_ps(t), y[h]);
    if constexpr (ASYM) y[h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(fsum), y[h]);
  }
}

// R (1 or 2) rows of x times one panel, its values decoded in registers.
template <int BITS, bool ASYM, typename ScaleT, int R, typename OutT>
void stream_panel(const Layout& layout, const uint8_t* panel, const IntX& x, const float* bias,
                  OutT* y, int64_t ldy, int64_t n) {
  constexpr int64_t kFeatures = block_features(BITS), kBytes = block_bytes(BITS);
  constexpr int32_t kZero = zero_point<BITS, ASYM>();
  // one row: two sets of sums per half, so that a block's vpaddd chains stay short
  constexpr int kSets = R == 1 ? 2 : 1;
  const int64_t blocks_per_span = x.span / kFeatures;
  const int64_t spans_per_group = layout.blocks_per_group / blocks_per_span;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  GroupWalk<ASYM, ScaleT> walk(layout, panel);
  int64_t span = 0;
  for (int64_t g = 0; g < layout.groups; ++g, walk.next()) {
    const uint8_t* block = walk.values();
    __m256 d[2], m[2];
    walk.scales(d, m);
    for (int64_t i = 0; i < spans_per_group; ++i, ++span) {
      __m256i s[R][2][kSets];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < kSets; ++t) s[r][h][t] = _mm256_setzero_si256();
      const int16_t* xs = x.q + span * x.span;
      for (int64_t b = 0; b < blocks_per_span; ++b, block += kBytes, xs += kFeatures) {
        for (int64_t at = 0; at < kBytes; at += 64)
          prefetch(block + kPrefetch + at);
        decode_words<BITS>(block, [&](int j, int h, int set, __m256i q) {
          for (int r = 0; r < R; ++r) {
            __m256i& sum = s[r][h][set % kSets];
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(q, pair(xs + r * x.k + 2 * j)));
          }
        });
      }
      for (int r = 0; r < R; ++r) {
        __m256i t[2];
        for (int h = 0; h < 2; ++h)
          t[h] = kSets == 2 ? _mm256_add_epi32(s[r][h][0], s[r][h][kSets - 1]) : s[r][h][0];
        add_span<ASYM, kZero>(acc[r], t, d, m, x.step[r * x.blocks + span * x.span / kXBlock],
                              kZero != 0 ? x.sums[r * x.spans + span] : 0,
                              ASYM ? x.fsums[r * x.spans + span] : 0.f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], bias, y + r * ldy, n);
}

// Rows [row, row + R) of x times spans [0, spans) of a decoded slab (pair vectors of
// int16 words, zero point taken off; span sp's d and m in d[sp], m[sp]), adding into the
// rows' outputs kept in `out` (16 floats a row). SPAN: x.span, 32 or 16 (a compile-time
// trip count and step index: the per-span tail was near half the time with both read
// from x at run time).
template <int R, bool ASYM, int SPAN>
void rows_times_slab(const int16_t* slab, int64_t spans, int64_t first_span,
                     const __m256 (*d)[2], const __m256 (*m)[2], const IntX& x, int64_t row,
                     float* out) {
  constexpr int kPairs = SPAN / 2;
  const int16_t* xr[R];
  const float* step[R];
  const float* fsum[R];
  float* o[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = x.q + (row + r) * x.k + first_span * SPAN;
    step[r] = x.step + (row + r) * x.blocks + first_span * SPAN / kXBlock;
    fsum[r] = ASYM ? x.fsums + (row + r) * x.spans + first_span : nullptr;
    o[r] = out + (row + r) * kLanes;
  }
  for (int64_t sp = 0; sp < spans; ++sp) {
    const int16_t* w = slab + sp * kPairs * 32;
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < kPairs; ++j) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * j + 16));
      for (int r = 0; r < R; ++r) {
        const __m256i xp = pair(xr[r] + 2 * j);
        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, xp));
        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, xp));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 y[2] = {_mm256_loadu_ps(o[r]), _mm256_loadu_ps(o[r] + 8)};
      add_span<ASYM, 0>(y, s[r], d[sp], m[sp], step[r][sp * SPAN / kXBlock], 0,
                        ASYM ? fsum[r][sp] : 0.f);
      _mm256_storeu_ps(o[r], y[0]);
      _mm256_storeu_ps(o[r] + 8, y[1]);
      xr[r] += SPAN;
    }
  }
}

// Any number of rows times one panel, a slab of up to 256 features at a time: the
// slab's values decoded once into `buffer` (8 KB, in L1) as int16 words with the zero
// point taken off, then 4 rows at a time multiply it, their outputs kept in `sums`
// (rows x 16).
template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void slab_panel(const Layout& layout, const uint8_t* panel, const IntX& x, int64_t rows,
                const float* bias, OutT* y, int64_t ldy, int64_t n, int16_t* buffer,
                float* sums) {
  constexpr int64_t kFeatures = block_features(BITS), kBytes = block_bytes(BITS);
  constexpr int64_t kSlabBlocks = kSlabFeatures / kFeatures;
  constexpr int32_t kZero = zero_point<BITS, ASYM>();
  const int64_t per_group = layout.blocks_per_group, blocks = layout.groups * per_group;
  std::fill(sums, sums + rows * kLanes, 0.f);
  __m256 d[kSlabFeatures / 16][2], m[kSlabFeatures / 16][2];  // per span of the slab
  __m256 dg[2], mg[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  GroupWalk<ASYM, ScaleT> walk(layout, panel);
  int64_t in_group = 0;  // block b's index in its group (walk's)
  for (int64_t b0 = 0; b0 < blocks; b0 += kSlabBlocks) {
    const int64_t count = std::min(kSlabBlocks, blocks - b0);
    for (int64_t b = b0; b < b0 + count; ++b) {
      if (in_group == per_group) {
        walk.next();
        in_group = 0;
      }
      if (b == b0 || in_group == 0) walk.scales(dg, mg);
      const int64_t feature = (b - b0) * kFeatures;
      if (feature % x.span == 0)
        for (int h = 0; h < 2; ++h) {
          d[feature / x.span][h] = dg[h];
          m[feature / x.span][h] = mg[h];
        }
      int16_t* out = buffer + feature * kLanes;
      decode_words<BITS>(walk.values() + in_group++ * kBytes, [&](int j, int h, int, __m256i q) {
        if constexpr (kZero != 0) q = _mm256_sub_epi16(q, _mm256_set1_epi16(kZero));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * j + 16 * h), q);
      });
    }
    const int64_t spans = count * kFeatures / x.span, first = b0 * kFeatures / x.span;
    // the next slab's bytes (and its scales) on their way into L2 while this one
    // multiplies: decoding waited on memory for a third of the time at 8 rows without
    const uint8_t* next = walk.values() + in_group * kBytes;
    for (int64_t at = 0; at < kSlabBlocks * kBytes * 9 / 8; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T1);
    auto multiply = [&](auto span) {
      constexpr int kSpan = decltype(span)::value;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        rows_times_slab<4, ASYM, kSpan>(buffer, spans, first, d, m, x, r, sums);
      if (rows - r == 3) rows_times_slab<3, ASYM, kSpan>(buffer, spans, first, d, m, x, r, sums);
      if (rows - r == 2) rows_times_slab<2, ASYM, kSpan>(buffer, spans, first, d, m, x, r, sums);
      if (rows - r == 1) rows_times_slab<1, ASYM, kSpan>(buffer, spans, first, d, m, x, r, sums);
    };
    if (x.span == kXBlock)
      multiply(std::integral_constant<int, kXBlock>{});
    else
      multiply(std::integral_constant<int, 16>{});
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 t[2] = {_mm256_loadu_ps(sums + r * kLanes), _mm256_loadu_ps(sums + r * kLanes + 8)};
    store_row(t, bias, y + r * ldy, n);
  }
}

// x quantized for one call of w's kernel (quantize_x), its tables in one buffer of the
// calling thread kept between calls (four at::empty a call were ~2 us of a batch-1
// decode's 120 calls, each ~20-60 us), or in `large` where they are too big to keep.
template <int BITS, bool ASYM>
IntX integer_x(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx, int64_t rows,
               bool zero_sums, std::vector<uint8_t>& large) {
  const int64_t k = w.in_features;
  constexpr int32_t kZero = zero_point<BITS, ASYM>();
  IntX xi;
  xi.k = k;
  xi.blocks = (k + kXBlock - 1) / kXBlock;
  xi.span = w.group_size % kXBlock == 0 ? kXBlock : 16;
  xi.spans = k / xi.span;
  const int64_t sum_count = kZero != 0 && zero_sums ? rows * xi.spans : 0;
  const int64_t fsum_count = ASYM ? rows * xi.spans : 0;
  const int64_t q_bytes = (rows * k * 2 + 31) / 32 * 32;
  const int64_t bytes = q_bytes + 4 * (rows * xi.blocks + sum_count + fsum_count);
  uint8_t* scratch = x_scratch(bytes, large);
  auto* q = reinterpret_cast<int16_t*>(scratch);
  auto* step = reinterpret_cast<float*>(scratch + q_bytes);
  auto* sums = sum_count ? reinterpret_cast<int32_t*>(step + rows * xi.blocks) : nullptr;
  auto* fsums = fsum_count ? reinterpret_cast<float*>(step + rows * xi.blocks) + sum_count : nullptr;
  quantize_x(x, ldx, rows, k, q, step, xi.span, sums);
  if (fsums) group_sums(x, ldx, rows, k, xi.span, fsums);
  xi.q = q;
  xi.step = step;
  xi.sums = sums;
  xi.fsums = fsums;
  return xi;
}

template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void run_gemm(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx, int64_t rows,
              const float* bias, OutT* y, int64_t ldy) {
  const Layout layout(w);
  const int64_t n = w.out_features, panels = w.data.size(0), stride = w.data.size(1);
  const auto* data = w.data.data_ptr<uint8_t>();
  std::vector<uint8_t> large;
  // (more than 2 rows: the slab takes the zero point off, without x's sums)
  const IntX xi = integer_x<BITS, ASYM>(w, x, ldx, rows, rows <= 2, large);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> buffer_storage;
    std::vector<float> sum_storage;
    int16_t* buffer = nullptr;
    if (rows > 2) {
      buffer_storage.resize(kSlabFeatures * kLanes + 16);  // + 16: 32-byte alignment
      buffer = buffer_storage.data() +
               (16 - reinterpret_cast<uintptr_t>(buffer_storage.data()) / 2 % 16) % 16;
      sum_storage.resize(rows * kLanes);
    }
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = data + p * stride;
      const float* b = bias ? bias + p * kLanes : nullptr;
      const int64_t valid = std::min(kLanes, n - p * kLanes);
      OutT* out = y + p * kLanes;
      if (rows == 1)
        stream_panel<BITS, ASYM, ScaleT, 1>(layout, panel, xi, b, out, ldy, valid);
      else if (rows == 2)
        stream_panel<BITS, ASYM, ScaleT, 2>(layout, panel, xi, b, out, ldy, valid);
      else
        slab_panel<BITS, ASYM, ScaleT>(layout, panel, xi, rows, b, out, ldy, valid, buffer,
                                       sum_storage.data());
    }
  });
}

}  // namespace avx2
#endif

#if LOOM_HAVE_INT16_STREAM
// Every row count of every format on AVX-512 with VNNI (1 to 8 rows with batch
// invariance off): integer products, as the AVX2 kernel takes them. x is rounded to int16 per block of 32 features as the AVX2 kernel
// rounds it (avx2::integer_x); each pair vector's 32 values are widened to words (8-bit:
// one vpmovsxbw; 4-bit: one vpmovzxbw gives two vectors' bytes, an and and a shift
// their nibbles; 5- and 6-bit: the plane's high bits or-ed in, as avx2::decode_words
// does) and multiplied with x's pair by one vpdpwssd per row (lane i: row i's two exact
// products, summed in int32); per span of 32 features (16 where a group is 16) the
// int32 sums are converted once and scaled by d * step, as avx2::add_span does, so the
// two kernels give the same bits. The bf16 path's decoding costs more per pair vector:
// 8-bit values take two widenings to int32, two conversions to float32 and one to bf16
// before each vdpbf16ps; 4-bit ones 128 + q by three instructions per two vectors. On
// the Intel VM of 2026-12-04 (benchmarks/quantized.md), where a 1B model's
// batch-1 decode read its weights at 45-55% of the read test (bound by instructions),
// per call against the bf16 path: 4- and 8-bit, 1-2 rows 0.41-0.91 of the time with the
// weights in cache, 0.67-0.94 from memory; 3-4 rows 0.30-0.73 and 0.50-0.93; 8 rows of
// 8-bit 0.58-0.79 (against the AMX tiles); 5- and 6-bit (Q5_0, Q5_K, Q6_K) 1 row
// 0.63-1.0, 2-8 rows 0.42-0.94 but for 0.9-1.07 at 8 rows in cache. The tiles stay
// ahead from 16 rows of 8-bit values (1.3-2x), and 4-bit ones at 8 rows in cache
// (1.15-1.2x; from memory 0.89-0.94: taken here). The cost is x's rounding: exact for
// every value within 2^8 of its block's largest, within half a step (2^-15 of the
// largest's power of two) for the rest (kernel_error_bound's x term, which
// quant_gemm_rounds_x tells it to add).
namespace int16_stream {

constexpr int64_t kMaxRows = 8;

// acc += vpdpwssd(a, b), in place. Where 16 sums are live (the slab's 4 rows x 4
// panels), GCC 12 compiles _mm512_dpwssd_epi32 into a copy of the accumulator to a fresh
// register beside each product, even for named variables: 1.5x the time at 32 rows.
inline void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// f(the I-th of eight vectors), I known at compile time. Sums a kernel keeps in
// registers are named variables handed to this, not an array: GCC 12 keeps an array of
// vectors that unrolled lambdas index in memory, or copies each element to a fresh
// register around every vpdpwssd (the slab's inner loop ran at 0.6x with a 16-element
// array, and spilled past 16).
template <int I, typename T, typename F>
inline void nth(F&& f, T& v0, T& v1, T& v2, T& v3, T& v4, T& v5, T& v6, T& v7) {
  static_assert(I >= 0 && I < 8, "nth: one of eight");
  if constexpr (I == 0) f(v0);
  else if constexpr (I == 1) f(v1);
  else if constexpr (I == 2) f(v2);
  else if constexpr (I == 3) f(v3);
  else if constexpr (I == 4) f(v4);
  else if constexpr (I == 5) f(v5);
  else if constexpr (I == 6) f(v6);
  else f(v7);
}

// f(j, k, words): pair vector j of the block at p (its k-th in order: the chain a
// one-row caller adds it to) as 32 int16 words, word 2i + c feature 2j + c of row i;
// 8-bit values signed as stored (q - 128), 4-, 5- and 6-bit ones as stored, in
// [0, 2^BITS) (the zero point is the caller's). 8-bit: one vpmovsxbw a vector; 4-bit:
// one vpmovzxbw gives two vectors' bytes, an and and a shift their nibbles; 5- and
// 6-bit: the plane's high bits or-ed in, as avx2::decode_words does.
template <int BITS, typename F>
inline void decode_pairs(const uint8_t* block, F&& f) {
  constexpr int kPairs = block_features(BITS) / 2;
  if constexpr (BITS == 8) {
    unrolled<kPairs>([&](auto j) {
      f(decltype(j)::value, j, _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j))));
    });
  } else {  // chunk c: pair vectors c (low nibbles) and c + kChunks (high), as stored
    constexpr int kChunks = kPairs / 2, kHigh = BITS - 4;
    __m512i plane = _mm512_setzero_si512();
    if constexpr (BITS != 4) plane = _mm512_loadu_si512(block + 32 * kChunks);
    // the plane's bits for the vector at `at` (kHigh a vector), moved to bit 4
    auto high_bits = [&](auto at) {
      constexpr int A = decltype(at)::value;
      const __m512i mask = _mm512_set1_epi16(((1 << kHigh) - 1) << 4);
      if constexpr (A >= 4)
        return _mm512_and_si512(_mm512_srli_epi16(plane, A - 4), mask);
      else
        return _mm512_and_si512(_mm512_slli_epi16(plane, 4 - A), mask);
    };
    unrolled<kChunks>([&](auto c) {
      constexpr int C = decltype(c)::value;
      const __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * C)));
      __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0x000F));
      __m512i hi = _mm512_srli_epi16(v, 4);
      if constexpr (BITS != 4) {
        lo = _mm512_or_si512(lo, high_bits(std::integral_constant<int, kHigh * C>{}));
        hi = _mm512_or_si512(hi, high_bits(std::integral_constant<int, kHigh * (C + kChunks)>{}));
      }
      f(C, std::integral_constant<int, 2 * C>{}, lo);
      f(C + kChunks, std::integral_constant<int, 2 * C + 1>{}, hi);
    });
  }
}

// One span's exact int32 sums t (zero point taken off) of a row into its 16 outputs'
// float32 sums: acc += d step t (+ m Xf), as avx2::add_span. Every path of this
// namespace ends a span here, in span order, so a row's bits are the same whichever
// path (and however many other rows) a call takes.
template <bool ASYM>
inline __m512 add_span(__m512 acc, __m512i t, __m512 d, __m512 m, float step, float fsum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(step)), _mm512_cvtepi32_ps(t), acc);
  if constexpr (ASYM) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(fsum), acc);
  return acc;
}

template <int BITS, bool ASYM, typename ScaleT, int R, typename OutT>
void panel_times_rows(const Layout& layout, const uint8_t* panel, const avx2::IntX& x,
                      const float* bias, OutT* y, int64_t ldy, int64_t cols) {
  constexpr int64_t kFeatures = block_features(BITS), kBytes = block_bytes(BITS);
  constexpr int kPairs = kFeatures / 2;   // pair vectors per block
  constexpr int kSets = R == 1 ? 4 : R == 2 ? 2 : 1;  // vpdpwssd chains per row
  static_assert(R * kSets <= 8, "panel_times_rows: eight int32 chains at most");
  constexpr int32_t kZero = avx2::zero_point<BITS, ASYM>();
  const int64_t blocks_per_span = x.span / kFeatures;
  const int64_t spans_per_group = layout.blocks_per_group / blocks_per_span;
  // row r's float32 sums: the r-th of f0..f7 (nth)
  __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;
  PanelWalk<ASYM, ScaleT> walk{panel};
  int64_t span = 0;
  for (int64_t g = 0; g < layout.groups; ++g, walk.next(layout)) {
    const uint8_t* block = walk.values(layout);
    __m512 d, m;
    walk.scales(layout, d, m);
    for (int64_t i = 0; i < spans_per_group; ++i, ++span) {
      // row r's chain t: the (r kSets + t)-th of s0..s7
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0,
              s6 = s0, s7 = s0;
      const int32_t* xs[R];  // the span's pairs of x, per row
      for (int r = 0; r < R; ++r)
        xs[r] = reinterpret_cast<const int32_t*>(x.q + r * x.k + span * x.span);
      for (int64_t b = 0; b < blocks_per_span; ++b, block += kBytes) {
        for (int64_t at = 0; at < kBytes; at += 64) prefetch(block + kPrefetch + at);
        const int64_t first = b * kPairs;
        // pair vector j of the block (its k-th: the chain it joins) times x's pair j
        decode_pairs<BITS>(block, [&](int j, auto k, __m512i q) {
          unrolled<R>([&](auto r) {
            nth<decltype(r)::value * kSets + decltype(k)::value % kSets>(
                [&](__m512i& sum) {
                  sum = _mm512_dpwssd_epi32(sum, q, _mm512_set1_epi32(xs[r][first + j]));
                },
                s0, s1, s2, s3, s4, s5, s6, s7);
          });
        });
      }
      unrolled<R>([&](auto r) {
        constexpr int kFirst = decltype(r)::value * kSets;
        // the row's chains added (integers: exact in any order)
        __m512i t = _mm512_setzero_si512();
        unrolled<kSets>([&](auto c) {
          nth<kFirst + decltype(c)::value>([&](__m512i& sum) { t = _mm512_add_epi32(t, sum); },
                                           s0, s1, s2, s3, s4, s5, s6, s7);
        });
        // S - z X, as the slab's values come with z taken off
        if constexpr (kZero != 0)
          t = _mm512_sub_epi32(t, _mm512_set1_epi32(kZero * x.sums[r * x.spans + span]));
        nth<decltype(r)::value>(
            [&](__m512& acc) {
              acc = add_span<ASYM>(acc, t, d, m,
                                   x.step[r * x.blocks + span * x.span / avx2::kXBlock],
                                   ASYM ? x.fsums[r * x.spans + span] : 0.f);
            },
            f0, f1, f2, f3, f4, f5, f6, f7);
      });
    }
  }
  const __m512 acc[8] = {f0, f1, f2, f3, f4, f5, f6, f7};
  store_rows<R>(reinterpret_cast<const __m512(&)[R]>(acc), bias, y, ldy, cols);
}

// acc += vpdpwssd(a, x's pair at p broadcast): the pair read by the instruction itself
// ({1to16}), in place (dpwssd's note).
inline void dpwssd_pair(__m512i& acc, __m512i a, const int32_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
}

// How far ahead of its block panel_times_row asks for the weights, into L1 (T0): its
// loop streams a byte in about half the instructions of the general one, and the L2
// hint 16 KB ahead (kPrefetch) that suited the general loop left it below the old
// loop's speed from memory. One thread on the Zen 5 VM, 1B shapes streamed from memory
// (Q4_K, Q6_K), against the L2 hint 16 KB ahead: into L1 8 KB ahead 0.79-0.92 of the
// time; 4 KB 1.13-1.28 of that, 16 KB 0.96-1.11, 2 KB 1.23-1.42; no software prefetch
// 1.09-1.39 of the L2 hint's.
constexpr int64_t kRowPrefetch = 8 * 1024;
inline void row_prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kRowPrefetch), _MM_HINT_T0);
}

// Chunk C's two pair vectors (C and C + kChunks) of a 4-, 5- or 6-bit block as int16
// words, as stored (decode_pairs' arithmetic, one chunk at a time).
template <int BITS, int C>
__attribute__((always_inline)) inline void chunk_words(const uint8_t* block, __m512i plane,
                                                       __m512i& lo, __m512i& hi) {
  constexpr int kChunks = BITS == 6 ? 4 : 8, kHigh = BITS - 4;
  const __m512i v =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * C)));
  lo = _mm512_and_si512(v, _mm512_set1_epi16(0x000F));
  hi = _mm512_srli_epi16(v, 4);
  if constexpr (BITS != 4) {
    const __m512i mask = _mm512_set1_epi16(((1 << kHigh) - 1) << 4);
    auto high_bits = [&](auto at) {  // the plane's bits for the vector at `at`, at bit 4
      constexpr int A = decltype(at)::value;
      if constexpr (A >= 4) return _mm512_and_si512(_mm512_srli_epi16(plane, A - 4), mask);
      else return _mm512_and_si512(_mm512_slli_epi16(plane, 4 - A), mask);
    };
    lo = _mm512_or_si512(lo, high_bits(std::integral_constant<int, kHigh * C>{}));
    hi = _mm512_or_si512(hi, high_bits(std::integral_constant<int, kHigh * (C + kChunks)>{}));
  }
}

// One block's pair vectors times x's pairs (xq: the block's first) into four int32
// chains: consecutive products into different chains.
template <int BITS>
__attribute__((always_inline)) inline void block_sums(const uint8_t* block, const int32_t* xq,
                                                      __m512i& s0, __m512i& s1, __m512i& s2,
                                                      __m512i& s3) {
  if constexpr (BITS == 8) {
    unrolled<4>([&](auto h) {
      constexpr int J = 2 * decltype(h)::value;
      auto words = [&](int j) {
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j)));
      };
      if constexpr (J % 4 == 0) {
        dpwssd_pair(s0, words(J), xq + J);
        dpwssd_pair(s1, words(J + 1), xq + J + 1);
      } else {
        dpwssd_pair(s2, words(J), xq + J);
        dpwssd_pair(s3, words(J + 1), xq + J + 1);
      }
    });
  } else {
    constexpr int kChunks = BITS == 6 ? 4 : 8;
    __m512i plane = _mm512_setzero_si512();
    if constexpr (BITS != 4) plane = _mm512_loadu_si512(block + 32 * kChunks);
    unrolled<kChunks / 2>([&](auto h) {
      constexpr int C = 2 * decltype(h)::value;
      __m512i lo0, hi0, lo1, hi1;
      chunk_words<BITS, C>(block, plane, lo0, hi0);
      chunk_words<BITS, C + 1>(block, plane, lo1, hi1);
      dpwssd_pair(s0, lo0, xq + C);
      dpwssd_pair(s1, hi0, xq + C + kChunks);
      dpwssd_pair(s2, lo1, xq + C + 1);
      dpwssd_pair(s3, hi1, xq + C + 1 + kChunks);
    });
  }
}

// One row times one panel where each group is one span (GROUP features: Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K, Q5_K and wint4 at groups of 32, Q6_K at 16): panel_times_rows<R =
// 1>'s integers and float epilogue, span by span in the same order (so the same bits),
// as a loop whose trip counts and offsets are constants: the group's blocks and x
// pairs, its scales (two-level: the super-block's factors loaded once), x's tables
// walked by pointer, the vpdpwssd reading x's pair itself. The general loop spent
// about as many instructions per group on its bookkeeping (run-time block and span
// counts, offsets recomputed, scalars spilled, accumulators copied) as on the weights:
// Q4_K ~140 a group of 32 features, Q6_K ~100 a group of 16, against ~70 and ~75
// here. One thread, 1B shapes with the weights in cache (Zen 5 VM): Q4_K 0.67-0.83 of
// the time, Q6_K 0.63-0.66, Q5_K 0.74, Q4_0 0.78-0.85, Q8_0 0.86-0.99.
template <int BITS, bool ASYM, typename ScaleT, int GROUP, typename OutT>
void panel_times_row(const Layout& layout, const uint8_t* panel, const avx2::IntX& x,
                     const float* bias, OutT* y, int64_t cols) {
  constexpr int64_t kFeatures = block_features(BITS), kBytes = block_bytes(BITS);
  constexpr int kBlocks = GROUP / kFeatures, kPairs = kFeatures / 2;
  constexpr bool kTwoLevel = std::is_same_v<ScaleT, int8_t>;
  constexpr int kUnitGroups = kTwoLevel ? kSuperBlock / GROUP : 1;
  constexpr int32_t kZero = avx2::zero_point<BITS, ASYM>();
  static_assert(GROUP % kFeatures == 0 && (GROUP == 16 || GROUP == 32), "one span a group");
  const auto* xq = reinterpret_cast<const int32_t*>(x.q);  // the row's pairs of x
  const int32_t* xsum = x.sums;  // per span (symmetric 4-, 5-, 6-bit)
  const float* fsum = x.fsums;   // per span (asymmetric)
  const float* step = x.step;    // per 32 features
  int64_t group = 0;
  __m512 acc = _mm512_setzero_ps();
  const uint8_t* unit = panel;
  const int64_t units = layout.groups / kUnitGroups, unit_bytes = layout.unit_bytes;
  const int64_t header = layout.header, super_bytes = layout.super_bytes();
  for (int64_t u = 0; u < units; ++u, unit += unit_bytes) {
    __m512 super_d = _mm512_setzero_ps(), super_m = super_d;
    const uint8_t* block = unit;
    const uint8_t* sub = unit + super_bytes;  // two-level: the int8 sub-scales
    if constexpr (kTwoLevel) {
      super_d = load_scales<c10::Half>(unit);
      if constexpr (ASYM) super_m = load_scales<c10::Half>(unit + 2 * kLanes);
      block = unit + header;
    }
    for (int g = 0; g < kUnitGroups; ++g) {
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t off = 0; off < kBytes; off += 64) row_prefetch(block + off);
      block_sums<BITS>(block, xq, s0, s1, s2, s3);
      if constexpr (kBlocks == 2) {
        for (int64_t off = 0; off < kBytes; off += 64) row_prefetch(block + kBytes + off);
        block_sums<BITS>(block + kBytes, xq + kPairs, s0, s1, s2, s3);
      }
      block += kBlocks * kBytes;
      __m512 d, m = _mm512_setzero_ps();
      if constexpr (kTwoLevel) {
        d = _mm512_mul_ps(super_d, int8x16_to_ps(sub + g * kLanes));
        if constexpr (ASYM)
          m = _mm512_mul_ps(super_m, int8x16_to_ps(sub + (kUnitGroups + g) * kLanes));
      } else {  // one-level: after the blocks
        d = load_scales<ScaleT>(block);
        if constexpr (ASYM) m = load_scales<ScaleT>(block + kLanes * sizeof(ScaleT));
      }
      __m512i t = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
      if constexpr (kZero != 0) t = _mm512_sub_epi32(t, _mm512_set1_epi32(kZero * *xsum++));
      acc = add_span<ASYM>(acc, t, d, m, step[group++ * GROUP / avx2::kXBlock],
                           ASYM ? *fsum++ : 0.f);
      xq += GROUP / 2;
    }
  }
  const __m512 out[1] = {acc};
  store_rows<1>(out, bias, y, 0, cols);
}

// The GROUP panel_times_row takes for w's layout (0: none, panel_times_rows<R = 1>).
template <int BITS>
inline int one_row_group(const Layout& layout, const avx2::IntX& x) {
  const int64_t group = layout.blocks_per_group * block_features(BITS);
  if (group != x.span) return 0;
  if constexpr (BITS == 6) return group == 16 ? 16 : 0;
  if constexpr (BITS == 8) return group == 32 ? 32 : group == 16 ? 16 : 0;
  return group == 32 ? 32 : 0;
}

// More than 8 rows: kSlabPanels panels (64 outputs) at a time, a slab of up to
// kSlabFeatures features of each decoded once into `buffer` (4 x 4 KB, in L1) as int16
// words with the zero point taken off, then kSlabRows rows at a time multiply it, one
// vpdpwssd per row, pair and panel (a pair of x broadcast once for the 4 panels), their
// float32 sums kept in `sums` (rows x 64) between slabs. A span's int32 sums are the
// very integers panel_times_rows sums and they end in the same add_span, so each row's
// outputs carry the same bits as they do with 1 to 8 rows, and as the AVX2 kernel's.
// (Per call, the default model's Q4_1 shapes at 9-64 rows take 1.0-1.2x the bf16
// path's time, its Q8_0 LM head 1.1-1.45x: a float epilogue per span of 32 features
// for every row and panel, and the decode into L1. Zen 5, one thread, 2026-12-06.)
constexpr int64_t kSlabFeatures = 128;
constexpr int kSlabPanels = 4;
constexpr int kSlabRows = 4;
constexpr int64_t kSlabPairs = kSlabFeatures / 2;

// Rows [row, row + R) times spans [first, first + spans) of the slab (pair j of panel v
// at buffer + (v * kSlabPairs + j) * 32 words; span sp's d and m at d[sp][v], m[sp][v]),
// in two passes: each span's R x P int32 sums (R x P registers, one broadcast of a row's
// x pair for the P panels) into `span_sums`, then row by row the spans' add_span into
// the float32 sums kept in `sums`, the P panels' chains side by side. (One pass holding
// both the int32 and the float32 sums in registers spilled them: 1.5x the time; blocks
// of 6 rows spilled too.)
template <int R, bool ASYM, int SPAN, int P>
void rows_times_slab(const int16_t* buffer, int64_t spans, int64_t first,
                     const __m512 (*d)[kSlabPanels], const __m512 (*m)[kSlabPanels],
                     const avx2::IntX& x, int64_t row, float* sums, __m512i* span_sums) {
  static_assert(R >= 1 && R <= 4 && (P == 1 || P == 4), "rows_times_slab: 1-4 rows, 1 or 4 panels");
  constexpr int kPairs = SPAN / 2;
  const int32_t* xs[R];
  for (int r = 0; r < R; ++r)
    xs[r] = reinterpret_cast<const int32_t*>(x.q + (row + r) * x.k + first * SPAN);
  for (int64_t sp = 0; sp < spans; ++sp) {
    // the sums of row r, panel v: named, not an array, so that they stay in registers (nth)
    __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00;
    __m512i s10 = s00, s11 = s00, s12 = s00, s13 = s00, s20 = s00, s21 = s00, s22 = s00;
    __m512i s23 = s00, s30 = s00, s31 = s00, s32 = s00, s33 = s00;
    const int16_t* w = buffer + sp * kPairs * 32;
    for (int j = 0; j < kPairs; ++j) {
      const __m512i w0 = _mm512_load_si512(w + j * 32);
      __m512i w1, w2, w3;
      if constexpr (P == 4) {
        w1 = _mm512_load_si512(w + (kSlabPairs + j) * 32);
        w2 = _mm512_load_si512(w + (2 * kSlabPairs + j) * 32);
        w3 = _mm512_load_si512(w + (3 * kSlabPairs + j) * 32);
      }
      auto row_times = [&](int r, __m512i& a0, __m512i& a1, __m512i& a2, __m512i& a3) {
        const __m512i xp = _mm512_set1_epi32(xs[r][sp * kPairs + j]);
        dpwssd(a0, w0, xp);
        if constexpr (P == 4) {
          dpwssd(a1, w1, xp);
          dpwssd(a2, w2, xp);
          dpwssd(a3, w3, xp);
        }
      };
      row_times(0, s00, s01, s02, s03);
      if constexpr (R > 1) row_times(1, s10, s11, s12, s13);
      if constexpr (R > 2) row_times(2, s20, s21, s22, s23);
      if constexpr (R > 3) row_times(3, s30, s31, s32, s33);
    }
    const __m512i all[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13},
                               {s20, s21, s22, s23}, {s30, s31, s32, s33}};
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < P; ++v) span_sums[(sp * R + r) * P + v] = all[r][v];
  }
  // row by row, its P panels' float32 sums as four independent chains (one chain at a
  // time waited on its two fmas' latency, span after span: a quarter of the time)
  for (int r = 0; r < R; ++r) {
    const float* step = x.step + (row + r) * x.blocks;
    const float* fsum = ASYM ? x.fsums + (row + r) * x.spans : nullptr;
    float* out = sums + (row + r) * kSlabPanels * kLanes;
    __m512 c0 = _mm512_loadu_ps(out), c1, c2, c3;
    if constexpr (P == 4) {
      c1 = _mm512_loadu_ps(out + kLanes);
      c2 = _mm512_loadu_ps(out + 2 * kLanes);
      c3 = _mm512_loadu_ps(out + 3 * kLanes);
    }
    for (int64_t sp = 0; sp < spans; ++sp) {
      const int64_t span = first + sp;
      const float st = step[span * SPAN / avx2::kXBlock], fs = ASYM ? fsum[span] : 0.f;
      const __m512i* t = span_sums + (sp * R + r) * P;
      c0 = add_span<ASYM>(c0, t[0], d[sp][0], m[sp][0], st, fs);
      if constexpr (P == 4) {
        c1 = add_span<ASYM>(c1, t[1], d[sp][1], m[sp][1], st, fs);
        c2 = add_span<ASYM>(c2, t[2], d[sp][2], m[sp][2], st, fs);
        c3 = add_span<ASYM>(c3, t[3], d[sp][3], m[sp][3], st, fs);
      }
    }
    _mm512_storeu_ps(out, c0);
    if constexpr (P == 4) {
      _mm512_storeu_ps(out + kLanes, c1);
      _mm512_storeu_ps(out + 2 * kLanes, c2);
      _mm512_storeu_ps(out + 3 * kLanes, c3);
    }
  }
}

// `rows` rows of x times P (1 or kSlabPanels) consecutive panels.
template <int BITS, bool ASYM, typename ScaleT, typename OutT, int P>
void panels_times_slabs(const Layout& layout, const uint8_t* first_panel, int64_t stride,
                        const avx2::IntX& x, int64_t rows, const float* bias, OutT* y,
                        int64_t ldy, int64_t cols, int16_t* buffer, float* sums) {
  constexpr int64_t kFeatures = block_features(BITS), kBytes = block_bytes(BITS);
  constexpr int64_t kSlabBlocks = kSlabFeatures / kFeatures;
  constexpr int kPairs = kFeatures / 2;
  constexpr int32_t kZero = avx2::zero_point<BITS, ASYM>();
  const int64_t per_group = layout.blocks_per_group, blocks = layout.groups * per_group;
  std::fill(sums, sums + rows * kSlabPanels * kLanes, 0.f);
  __m512 d[kSlabFeatures / 16][kSlabPanels], m[kSlabFeatures / 16][kSlabPanels];
  __m512i span_sums[kSlabFeatures / 16 * kSlabRows * kSlabPanels];
  PanelWalk<ASYM, ScaleT> walks[P];
  __m512 dg[P], mg[P];
  for (int v = 0; v < P; ++v) {
    walks[v] = PanelWalk<ASYM, ScaleT>{first_panel + v * stride};
    mg[v] = _mm512_setzero_ps();
  }
  int64_t in_group = 0;  // block b's index in its group
  for (int64_t b0 = 0; b0 < blocks; b0 += kSlabBlocks) {
    const int64_t count = std::min(kSlabBlocks, blocks - b0);
    for (int64_t b = b0; b < b0 + count; ++b) {
      if (in_group == per_group) {
        for (int v = 0; v < P; ++v) walks[v].next(layout);
        in_group = 0;
      }
      if (in_group == 0)
        for (int v = 0; v < P; ++v) walks[v].scales(layout, dg[v], mg[v]);
      const int64_t feature = (b - b0) * kFeatures;
      if (feature % x.span == 0)
        for (int v = 0; v < P; ++v) {
          d[feature / x.span][v] = dg[v];
          m[feature / x.span][v] = mg[v];
        }
      for (int v = 0; v < P; ++v) {
        const uint8_t* block = walks[v].values(layout) + in_group * kBytes;
        for (int64_t at = 0; at < kBytes; at += 64) prefetch(block + kSlabBlocks * kBytes + at);
        int16_t* out = buffer + (v * kSlabPairs + (b - b0) * kPairs) * 32;
        decode_pairs<BITS>(block, [&](int j, auto, __m512i q) {
          if constexpr (kZero != 0) q = _mm512_sub_epi16(q, _mm512_set1_epi16(kZero));
          _mm512_store_si512(out + 32 * j, q);
        });
      }
      ++in_group;
    }
    const int64_t spans = count * kFeatures / x.span, first = b0 * kFeatures / x.span;
    auto multiply = [&](auto span) {
      constexpr int kSpan = decltype(span)::value;
      int64_t r = 0;
      for (; r + kSlabRows <= rows; r += kSlabRows)
        rows_times_slab<kSlabRows, ASYM, kSpan, P>(buffer, spans, first, d, m, x, r, sums,
                                                   span_sums);
      if (r < rows)
        with_rows<kSlabRows - 1>(rows - r, [&](auto n) {
          rows_times_slab<decltype(n)::value, ASYM, kSpan, P>(buffer, spans, first, d, m, x, r,
                                                              sums, span_sums);
        });
    };
    if (x.span == avx2::kXBlock)
      multiply(std::integral_constant<int, avx2::kXBlock>{});
    else
      multiply(std::integral_constant<int, 16>{});
  }
  for (int v = 0; v < P; ++v) {
    const int64_t valid = std::min<int64_t>(kLanes, cols - v * kLanes);
    if (valid <= 0) break;
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 acc[1] = {_mm512_loadu_ps(sums + (r * kSlabPanels + v) * kLanes)};
      store_rows<1>(acc, bias ? bias + v * kLanes : nullptr, y + r * ldy + v * kLanes, ldy,
                    valid);
    }
  }
}

// Whether this kernel takes a call: every row count where batch invariance is on (the
// default), else 1 to 8 rows (more take the bf16 path and the tiles, faster on CPUs with
// AMX; quantized_linear's note).
inline bool takes(int64_t rows) { return rows <= kMaxRows || batch_invariant(); }

template <int BITS, bool ASYM, typename ScaleT, typename OutT>
void run_gemm(const QuantizedWeight& w, const c10::BFloat16* x, int64_t ldx, int64_t rows,
              const float* bias, OutT* y, int64_t ldy) {
  std::vector<uint8_t> large;  // x's tables where too big for the thread's buffer
  // (more than 8 rows: the slab takes the zero point off, without x's sums)
  const avx2::IntX xi =
      avx2::integer_x<BITS, ASYM>(w, x, ldx, rows, rows <= kMaxRows, large);
  const Layout layout(w);
  const auto* data = w.data.data_ptr<uint8_t>();
  const int64_t n = w.out_features, panels = w.data.size(0), stride = w.data.size(1);
  if (rows == 1 && one_row_group<BITS>(layout, xi) != 0) {
    const int group = one_row_group<BITS>(layout, xi);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* b = bias ? bias + p * kLanes : nullptr;
        const int64_t cols = std::min(kLanes, n - p * kLanes);
        if constexpr (BITS != 6)
          if (group == 32) {
            panel_times_row<BITS, ASYM, ScaleT, 32>(layout, data + p * stride, xi, b,
                                                    y + p * kLanes, cols);
            continue;
          }
        if constexpr (BITS == 6 || BITS == 8)
          panel_times_row<BITS, ASYM, ScaleT, 16>(layout, data + p * stride, xi, b,
                                                  y + p * kLanes, cols);
      }
    });
    return;
  }
  if (rows <= kMaxRows) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* b = bias ? bias + p * kLanes : nullptr;
        const int64_t cols = std::min(kLanes, n - p * kLanes);
        with_rows<kMaxRows>(rows, [&](auto r) {
          panel_times_rows<BITS, ASYM, ScaleT, decltype(r)::value>(
              layout, data + p * stride, xi, b, y + p * kLanes, ldy, cols);
        });
      }
    });
    return;
  }
  // Work items (chunk of rows, pair of panels), panels inner; a chunk's x (up to 96 rows
  // of a slab: 48 KB) stays in L2 while the thread's panels pass.
  const int64_t chunks = (rows + kMaxRowChunk - 1) / kMaxRowChunk;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  const int64_t pairs = (panels + kSlabPanels - 1) / kSlabPanels;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int16_t buffer[kSlabPanels * kSlabPairs * 32];
    std::vector<float> sums(chunk_rows * kSlabPanels * kLanes);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / pairs, p = item % pairs * kSlabPanels;
      const int64_t r0 = chunk * chunk_rows, nrows = std::min(chunk_rows, rows - r0);
      if (nrows <= 0) continue;
      avx2::IntX part = xi;  // the chunk's rows
      part.q += r0 * xi.k;
      part.step += r0 * xi.blocks;
      if (part.fsums) part.fsums += r0 * xi.spans;
      if (p + kSlabPanels <= panels) {
        panels_times_slabs<BITS, ASYM, ScaleT, OutT, kSlabPanels>(
            layout, data + p * stride, stride, part, nrows, bias ? bias + p * kLanes : nullptr,
            y + r0 * ldy + p * kLanes, ldy, std::min(kSlabPanels * kLanes, n - p * kLanes),
            buffer, sums.data());
        continue;
      }
      for (int64_t q = p; q < panels; ++q)  // the last few panels, one at a time
        panels_times_slabs<BITS, ASYM, ScaleT, OutT, 1>(
            layout, data + q * stride, stride, part, nrows, bias ? bias + q * kLanes : nullptr,
            y + r0 * ldy + q * kLanes, ldy, std::min(kLanes, n - q * kLanes), buffer,
            sums.data());
    }
  });
}

}  // namespace int16_stream
#endif

}  // namespace

bool quant_gemm_available() { return LOOM_HAVE_QUANT_GEMM || LOOM_HAVE_QUANT_GEMM_AVX2; }

bool quant_gemm_rounds_x(int64_t rows) {
#if LOOM_HAVE_QUANT_GEMM
  if (use_avx512()) {
#if LOOM_HAVE_INT16_STREAM
    return int16_stream::takes(rows);
#else
    return false;
#endif
  }
#endif
  return LOOM_HAVE_QUANT_GEMM_AVX2;
}

QuantizedWeight pack_quantized_weight(at::Tensor values, at::Tensor scales,
                                      c10::optional<at::Tensor> offsets, int64_t bits,
                                      c10::optional<at::Tensor> super_scales,
                                      c10::optional<at::Tensor> super_offsets) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "pack_quantized_weight: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kByte && values.dim() == 2,
              "values must be a 2-d uint8 CPU tensor");
  const bool two_level = super_scales.has_value() && super_scales->defined();
  const bool asymmetric = offsets.has_value() && offsets->defined();
  const int64_t n = values.size(0), k = values.size(1);
  if (two_level) {
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.scalar_type() == at::kChar &&
                    super_scales->scalar_type() == at::kHalf && k % kSuperBlock == 0 &&
                    super_scales->sizes() == at::IntArrayRef({n, k / kSuperBlock}),
                "two-level scales: int8 scales (N, groups) and float16 super_scales (N, K / ",
                kSuperBlock, "), K a multiple of ", kSuperBlock, "; got ", k, " features");
  } else {
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n &&
                    (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
                "scales must be (N, groups) float16 or float32");
  }
  if (asymmetric) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() &&
                    offsets->scalar_type() == scales.scalar_type(),
                "offsets must have the shape and dtype of scales");
  }
  TORCH_CHECK(two_level ? (asymmetric == (super_offsets.has_value() && super_offsets->defined()))
                        : !(super_offsets.has_value() && super_offsets->defined()),
              "super_offsets come with two-level offsets, and only with them");
  if (two_level && asymmetric) {
    TORCH_CHECK(super_offsets->sizes() == super_scales->sizes() &&
                    super_offsets->scalar_type() == at::kHalf,
                "super_offsets must have the shape and dtype of super_scales");
  }
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % block_features(bits) == 0 &&
                  (!two_level || kSuperBlock % (k / groups) == 0),
              "pack_quantized_weight: ", k, " input features in ", groups,
              " groups: each group must be a multiple of ", block_features(bits),
              " features at ", bits, " bits", two_level ? " that divides 256" : "");
  QuantizedWeight w;
  w.out_features = n;
  w.in_features = k;
  w.bits = bits;
  w.group_size = k / groups;
  w.asymmetric = asymmetric;
  w.float_scales = !two_level && scales.scalar_type() == at::kFloat;
  w.two_level = two_level;
  const Layout layout(w);
  const int64_t panels = (n + kLanes - 1) / kLanes;
  const int64_t stride = layout.panel_bytes();
  w.data = at::zeros({panels, stride}, values.options());
  const auto v = values.contiguous();
  const auto s = scales.contiguous();
  const auto o = asymmetric ? offsets->contiguous() : at::Tensor();
  const auto ss = two_level ? super_scales->contiguous() : at::Tensor();
  const auto so = two_level && asymmetric ? super_offsets->contiguous() : at::Tensor();
  const auto* vp = v.data_ptr<uint8_t>();
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
  };
  auto* out = w.data.data_ptr<uint8_t>();
  const int64_t scale_size = s.element_size();
  const int64_t features = block_features(bits);
  const int64_t limit = (1 << bits) - 1;
  TORCH_CHECK(v.max().item<uint8_t>() <= limit, "values must be below 2^", bits);
  const int64_t supers = k / kSuperBlock;
  // table (N, columns) of `size`-byte entries: rows of panel p, column c -> 16 entries
  auto copy_lanes = [&](uint8_t* dst, const uint8_t* table, int64_t columns, int64_t c,
                        int64_t size, int64_t p) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t row = p * kLanes + lane;
      if (row < n)
        std::memcpy(dst + lane * size, table + (row * columns + c) * size, size);
    }
  };
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = out + p * stride;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* dst = const_cast<uint8_t*>(layout.values(panel, g));
        for (int64_t i = 0; i < layout.blocks_per_group; ++i, dst += block_bytes(bits)) {
          const int64_t k0 = (g * layout.blocks_per_group + i) * features;
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const int64_t row = p * kLanes + lane;
            if (row >= n) continue;
            for (int64_t f = 0; f < features; ++f)
              set_block_value(dst, bits, lane, f, vp[row * k + k0 + f]);
          }
        }
        uint8_t* sc = const_cast<uint8_t*>(layout.scales(panel, g));
        copy_lanes(sc, bytes(s), groups, g, scale_size, p);
        if (asymmetric)
          copy_lanes(two_level ? const_cast<uint8_t*>(layout.sub_offsets(panel, g))
                               : sc + kLanes * scale_size,
                     bytes(o), groups, g, scale_size, p);
        if (two_level && g % layout.groups_per_unit == 0) {
          uint8_t* super = const_cast<uint8_t*>(layout.unit(panel, g));
          copy_lanes(super, bytes(ss), supers, g / layout.groups_per_unit, 2, p);
          if (asymmetric)
            copy_lanes(super + 2 * kLanes, bytes(so), supers, g / layout.groups_per_unit, 2, p);
        }
      }
    }
  });
  return w;
}

std::vector<c10::optional<at::Tensor>> unpack_quantized_weight(const QuantizedWeight& w) {
  TORCH_CHECK(w.data.defined(), "unpack_quantized_weight: the weight is empty");
  const Layout layout(w);
  const int64_t n = w.out_features, k = w.in_features, groups = layout.groups;
  const int64_t features = block_features(w.bits), stride = w.data.size(1);
  const int64_t supers = k / kSuperBlock;
  const auto scale_type = w.two_level ? at::kChar : w.float_scales ? at::kFloat : at::kHalf;
  auto values = at::empty({n, k}, w.data.options());
  auto scales = at::empty({n, groups}, w.data.options().dtype(scale_type));
  auto offsets = w.asymmetric ? at::empty({n, groups}, scales.options()) : at::Tensor();
  auto super_scales =
      w.two_level ? at::empty({n, supers}, w.data.options().dtype(at::kHalf)) : at::Tensor();
  auto super_offsets =
      w.two_level && w.asymmetric ? at::empty({n, supers}, super_scales.options()) : at::Tensor();
  const auto* in = w.data.data_ptr<uint8_t>();
  auto* vp = values.data_ptr<uint8_t>();
  auto bytes = [](at::Tensor& t) {
    return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
  };
  const int64_t scale_size = scales.element_size();
  const int64_t panels = w.data.size(0);
  // 16 entries of `size` bytes at src -> column c of table (N, columns), panel p's rows
  auto copy_lanes = [&](uint8_t* table, const uint8_t* src, int64_t columns, int64_t c,
                        int64_t size, int64_t p) {
    for (int64_t lane = 0; lane < kLanes && p * kLanes + lane < n; ++lane)
      std::memcpy(table + ((p * kLanes + lane) * columns + c) * size, src + lane * size, size);
  };
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = in + p * stride;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* src = layout.values(panel, g);
        for (int64_t i = 0; i < layout.blocks_per_group; ++i, src += block_bytes(w.bits)) {
          const int64_t k0 = (g * layout.blocks_per_group + i) * features;
          for (int64_t lane = 0; lane < kLanes && p * kLanes + lane < n; ++lane)
            for (int64_t f = 0; f < features; ++f)
              vp[(p * kLanes + lane) * k + k0 + f] =
                  static_cast<uint8_t>(block_value(src, w.bits, lane, f));
        }
        const uint8_t* sc = layout.scales(panel, g);
        copy_lanes(bytes(scales), sc, groups, g, scale_size, p);
        if (w.asymmetric)
          copy_lanes(bytes(offsets), w.two_level ? layout.sub_offsets(panel, g)
                                                 : sc + kLanes * scale_size,
                     groups, g, scale_size, p);
        if (w.two_level && g % layout.groups_per_unit == 0) {
          const uint8_t* super = layout.unit(panel, g);
          copy_lanes(bytes(super_scales), super, supers, g / layout.groups_per_unit, 2, p);
          if (w.asymmetric)
            copy_lanes(bytes(super_offsets), super + 2 * kLanes, supers,
                       g / layout.groups_per_unit, 2, p);
        }
      }
    }
  });
  auto optional = [](const at::Tensor& t) {
    return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  };
  return {values, scales, optional(offsets), optional(super_scales), optional(super_offsets)};
}

void dequantize_rows(at::Tensor out, const QuantizedWeight& w, at::Tensor ids) {
  TORCH_CHECK(w.data.defined(), "dequantize_rows: the weight is empty");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be 1-d int64");
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) &&
                  out.size(1) == w.in_features,
              "out must be (len(ids), ", w.in_features, ") bfloat16 or float32, contiguous");
  const Layout layout(w);
  const int64_t k = w.in_features, groups = layout.groups, stride = w.data.size(1);
  const int64_t features = block_features(w.bits);
  const float zero_point = w.asymmetric ? 0.f : static_cast<float>(1 << (w.bits - 1));
  const auto ids_c = ids.contiguous();
  const int64_t* idp = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < w.out_features, "dequantize_rows: row ", idp[i],
                " is out of range [0, ", w.out_features, ")");
  const auto* data = w.data.data_ptr<uint8_t>();
  auto half_at = [](const uint8_t* p, int64_t lane) {
    c10::Half h;
    std::memcpy(&h, p + 2 * lane, 2);
    return static_cast<float>(h);
  };
  // group g's d and m for row `lane`, as QuantizedTensor.dequantize computes them
  auto scale_offset = [&](const uint8_t* panel, int64_t g, int64_t lane, float& d, float& m) {
    const uint8_t* s = layout.scales(panel, g);
    m = 0.f;
    if (w.two_level) {  // exact products
      const uint8_t* super = layout.unit(panel, g);
      d = half_at(super, lane) * static_cast<float>(static_cast<int8_t>(s[lane]));
      if (w.asymmetric)
        m = half_at(super + 2 * kLanes, lane) *
            static_cast<float>(static_cast<int8_t>(layout.sub_offsets(panel, g)[lane]));
    } else if (w.float_scales) {
      std::memcpy(&d, s + 4 * lane, 4);
      if (w.asymmetric) std::memcpy(&m, s + 4 * (kLanes + lane), 4);
    } else {
      d = half_at(s, lane);
      if (w.asymmetric) m = half_at(s + 2 * kLanes, lane);
    }
  };
  LOOM_DISPATCH(out.scalar_type(), "dequantize_rows", [&] {
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, ids.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t lane = idp[i] % kLanes;
        const uint8_t* panel = data + (idp[i] / kLanes) * stride;
        for (int64_t g = 0; g < groups; ++g) {
          float d, m;
          scale_offset(panel, g, lane, d, m);
          const uint8_t* src = layout.values(panel, g);
          for (int64_t b = 0; b < layout.blocks_per_group; ++b, src += block_bytes(w.bits)) {
            scalar_t* dst = op + i * k + (g * layout.blocks_per_group + b) * features;
            for (int64_t f = 0; f < features; ++f) {
              const float q = static_cast<float>(block_value(src, w.bits, lane, f));
              // as QuantizedTensor.dequantize: d * (q - z), or d * q + m
              dst[f] = from_float<scalar_t>(w.asymmetric ? q * d + m : (q - zero_point) * d);
            }
          }
        }
      }
    });
  });
}

void quantized_linear(at::Tensor out, at::Tensor x, const QuantizedWeight& weight,
                      c10::optional<at::Tensor> bias) {
  TORCH_CHECK(LOOM_HAVE_QUANT_GEMM || LOOM_HAVE_QUANT_GEMM_AVX2,
              "quantized_linear needs a CPU with AVX512-BF16, or AVX2 with FMA and F16C");
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
  [[maybe_unused]] const auto* xp = x.data_ptr<c10::BFloat16>();
  [[maybe_unused]] const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  // gemm(bits, asymmetric, Tag<scale type>, y): a kernel's run_gemm for w's format
  [[maybe_unused]] auto run = [&](auto gemm) {  // (no kernel: the check above threw)
    with_format(weight, [&](auto bits, auto asym, auto scale) {
      if (out.scalar_type() == at::kFloat)
        gemm(bits, asym, scale, out.data_ptr<float>());
      else
        gemm(bits, asym, scale, out.data_ptr<c10::BFloat16>());
    });
  };
#define LOOM_RUN_GEMM(KERNEL)                                                          \
  run([&](auto bits, auto asym, auto scale, auto* y) {                                 \
    KERNEL<decltype(bits)::value, decltype(asym)::value, typename decltype(scale)::type>( \
        weight, xp, x.stride(0), rows, bp, y, out.stride(0));                          \
  })
#if LOOM_HAVE_INT16_STREAM
  if (use_avx512() && int16_stream::takes(rows)) {
    LOOM_RUN_GEMM(int16_stream::run_gemm);
    return;
  }
#endif
#if LOOM_HAVE_QUANT_GEMM
  if (use_avx512()) {
    LOOM_RUN_GEMM(run_gemm);
    return;
  }
#endif
#if LOOM_HAVE_QUANT_GEMM_AVX2
  LOOM_RUN_GEMM(avx2::run_gemm);
#endif
#undef LOOM_RUN_GEMM
}

}  // namespace loom
