// y = x W^T (+ bias) for bfloat16 x and W on CPUs with AVX512-BF16, float32 sums.
//
// A linear layer's weight (N, K) is packed once (pack_bf16_weight) into panels of 64
// output features: panel p holds, for each pair of input features k = 2i, 2i+1, the
// 64 features' two weights side by side ((N/64, K/2, 64, 2), zero-padded to whole
// panels). One vdpbf16ps then multiplies a broadcast pair of x's features into 16
// outputs, and a panel's weights stream in the order the kernel reads them.
//
// One row, or a few (fewer than 8, or K not a multiple of 32), run the AVX-512
// micro-kernel: up to 6 rows x 64 outputs of sums in 24 registers; 7-12 rows, half a
// panel at a time (12 x 32 sums), so that the panel is still read once (a 1B model's
// 8-row decode step took 1.36x a 1-row one, now 1.0x; the 2-core Zen 5 VM). Panels are split
// across threads; a panel is read from memory once per 96 rows and then from L2 while
// it fits there (128 B per input feature). A decode step at batch 1 streams the weights
// once, about as fast as memory allows (ATen's GEMV and oneDNN take 2-3x longer).
//
// More rows run on the AMX tile units where the CPU has them and the OS grants them
// (amx_permitted; LOOM_AMX=0, loom/envs.py, turns them off): the same panels are the tiles' B operand
// as they are (16 pairs x 16 outputs, rows 256 bytes apart), so one copy of the weights
// serves both paths. 8-16 rows (decode) in one block of all 64 outputs, so a panel
// streams once, in order (a 1B model's matmuls at 8 rows 107 -> 93 ms a step, 1 row 86);
// more in 32 x 32 blocks, 4 tile products per 4 tile loads. Measured on the
// 2-core AVX512-BF16 + AMX VM (benchmarks/cpu_kernels.md): the default model's prefill
// of 128 tokens 585 -> 1,648 tok/s, batch-32 decode 375 -> 786 tok/s; a 16,384 x 2,048
// layer at 32 rows 16.4 -> 4.3 ms (oneDNN, which also uses AMX here, 6.4 ms).
//
// Sums are rounded to bf16 once (round to nearest even), as torch rounds a bf16
// matmul's float32 result, or kept in float32 (an LM head's logits: two tokens one
// bf16 step apart stay apart). Both paths add each pair's two products to sums that
// start from the bias, pair after pair, so small-integer inputs give exact results on
// either (tests/model/test_kernels.py).

#include "bf16_gemm.h"

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LOOM_HAVE_BF16_GEMM 1
#else
#define LOOM_HAVE_BF16_GEMM 0
#endif

#include "amx.h"

#if LOOM_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace loom {
namespace {

constexpr int64_t kPanel = 64;    // output features per panel: 4 vectors of 16
constexpr int64_t kRowBlock = 6;  // rows per micro-kernel call
constexpr int64_t kMaxRowChunk = 96;  // rows that share one pass over a panel
// How far ahead a single pass over a panel prefetches (micro_kernel with one row block,
// amx_block_wide). A whole panel ahead, as before, is 1 MB for K = 8,192: a 1B model's
// 2,048 x 8,192 layer streamed at 18-20 GB/s against 25-27 for its other shapes, and at
// 25-27 with 64 KB (16 KB 0.9-1.0x, 256 KB 1.0-1.03x the time of 64 KB over its shapes;
// the 2-core Intel AMX VM, 2026-12-04).
constexpr int64_t kStreamAhead = 64 * 1024;

#if LOOM_HAVE_BF16_GEMM
// The byte `at` bytes on from the start of `panel` (`panel_bytes` long) in the thread's
// stream of weights: in the panel, or past its end in `next` (or null: nothing to ask for).
inline const char* stream_at(const c10::BFloat16* panel, int64_t panel_bytes, int64_t at,
                             const char* next) {
  return at < panel_bytes ? reinterpret_cast<const char*>(panel) + at
         : next ? next + (at - panel_bytes) : nullptr;
}

// Rows [0, MR) of x times one panel, over the whole K; writes `cols` (<= 64) outputs.
// `prefetch` (or null) is the next stretch of weights the thread will read: its
// `prefetch_lines` cache lines are requested into L2 a few per pair of features. With
// `stream_ahead`, each pair asks for the line `stream_ahead` bytes on instead, in this
// panel or past its end in `stream_next` (or null).
template <int MR, typename OutT>
void micro_kernel(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel,
                  int64_t pairs, const float* bias, OutT* y, int64_t ldy,
                  int64_t cols, const char* prefetch, int64_t prefetch_lines,
                  int64_t stream_ahead = 0, const char* stream_next = nullptr) {
  __m512 acc[MR][4];
  for (int v = 0; v < 4; ++v) {
    const __m512 init = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) acc[r][v] = init;
  }
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  const auto* w = reinterpret_cast<const __m512i*>(panel);
  const int64_t per_pair = prefetch ? (prefetch_lines + pairs - 1) / pairs : 0;
  const char* prefetch_end = prefetch ? prefetch + 64 * prefetch_lines : nullptr;
  const int64_t panel_bytes = pairs * kPanel * 4;
  for (int64_t i = 0; i < pairs; ++i, w += 4) {
    if (stream_ahead) {
      const char* ahead = stream_at(panel, panel_bytes, i * kPanel * 4 + stream_ahead,
                                    stream_next);
      if (ahead)
        for (int l = 0; l < 4; ++l) __builtin_prefetch(ahead + 64 * l, 0, 2);
    }
    for (int64_t l = 0; l < per_pair && prefetch < prefetch_end; ++l, prefetch += 64)
      __builtin_prefetch(prefetch, 0, 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][i]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < MR; ++r) {
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, acc[r][v]);
      else
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask,
                                 (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
    }
  }
}

// Rows [0, MR) of x (7-12 rows) times half a panel: its outputs 32h .. 32h + 31 (h = `half`),
// two vectors a row, MR x 2 sums in registers. Two halves make the panel in one pass over
// its weights: each reads its two of a pair's four cache lines, and streams `stream_ahead`
// bytes ahead into its own lines; past the panel's end, half 0 asks for half 1's lines
// of the same panel, half 1 for half 0's of `stream_next` (or null). Where two blocks of
// rows (6 + the rest) read a panel twice, the second time from L2 if it fits (1 MB for
// K = 8,192 does not): a 1B model's 8-row decode step read its weights at ~2/3 the speed
// of a 6-row one. Each output's sums are the full kernel's, pair after pair from the bias:
// a row's values do not depend on how many rows run beside it.
template <int MR, typename OutT>
void half_panel_kernel(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel,
                       int64_t pairs, const float* bias, OutT* y, int64_t ldy, int64_t cols,
                       int half, int64_t stream_ahead, const char* stream_next) {
  __m512 acc[MR][2];
  for (int v = 0; v < 2; ++v) {
    const __m512 init =
        bias ? _mm512_loadu_ps(bias + 32 * half + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) acc[r][v] = init;
  }
  const int32_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  const char* base = reinterpret_cast<const char*>(panel);
  const int64_t row_bytes = kPanel * 4;  // a pair of input features: 64 outputs x 2 bf16
  const int64_t ahead_rows = stream_ahead / row_bytes;
  const auto* w = reinterpret_cast<const __m512i*>(panel) + 2 * half;
  for (int64_t i = 0; i < pairs; ++i, w += 4) {
    const int64_t j = i + ahead_rows;  // the pair row asked for now
    const char* ahead = nullptr;
    if (j < pairs) {
      ahead = base + j * row_bytes + 128 * half;
    } else if (half == 0) {
      ahead = base + (j - pairs) * row_bytes + 128;  // this panel's half 1
    } else if (stream_next) {
      ahead = stream_next + (j - pairs) * row_bytes;  // the next panel's half 0
    }
    if (ahead) {
      __builtin_prefetch(ahead, 0, 2);
      __builtin_prefetch(ahead + 64, 0, 2);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][i]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int v = 0; v < 2; ++v) {
    const int64_t left = cols - 32 * half - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < MR; ++r) {
      OutT* out = y + r * ldy + 32 * half + 16 * v;
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_mask_storeu_ps(out, mask, acc[r][v]);
      else
        _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
    }
  }
}

template <typename OutT>
void rows_times_half_panels(const c10::BFloat16* x, int64_t ldx, int64_t rows,
                            const c10::BFloat16* panel, int64_t pairs, const float* bias,
                            OutT* y, int64_t ldy, int64_t cols, const c10::BFloat16* next) {
  const char* stream_next = reinterpret_cast<const char*>(next);
  for (int half = 0; half < 2 && 32 * half < cols; ++half) {
    switch (rows) {
#define LOOM_HALF_PANEL(MR)                                                                 \
  case MR:                                                                                  \
    half_panel_kernel<MR, OutT>(x, ldx, panel, pairs, bias, y, ldy, cols, half,             \
                                kStreamAhead, stream_next);                                 \
    break;
      LOOM_HALF_PANEL(7)
      LOOM_HALF_PANEL(8)
      LOOM_HALF_PANEL(9)
      LOOM_HALF_PANEL(10)
      LOOM_HALF_PANEL(11)
      default: half_panel_kernel<12, OutT>(x, ldx, panel, pairs, bias, y, ldy, cols, half,
                                           kStreamAhead, stream_next);
#undef LOOM_HALF_PANEL
    }
  }
}

// All `rows` rows times one panel, in blocks of kRowBlock rows and a last, smaller one,
// or from three blocks on as even as kRowBlock allows (32 = 6 + 6 + 5 + 5 + 5 + 5, not
// five 6s and a 2, whose 8 sums per pair wait out the vdpbf16ps latency for the same
// loads: a 1B model's shapes, cold, on the 2-core Zen 5 VM 1.00-1.07x the speed at 32
// rows, 1.05-1.16x at 20; at 7 and 8 rows, 4 + 3 and 4 + 4 measured 0.86-1.06x, so two
// blocks stay 6 + the rest); while they compute, the panel at `next` (or null) is
// prefetched, a share per row block.
template <typename OutT>
void rows_times_panel(const c10::BFloat16* x, int64_t ldx, int64_t rows,
                      const c10::BFloat16* panel, int64_t pairs, const float* bias,
                      OutT* y, int64_t ldy, int64_t cols, const c10::BFloat16* next) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t panel_lines = pairs * kPanel * 2 * 2 / 64;
  const int64_t lines = (panel_lines + blocks - 1) / blocks;
  const char* prefetch = reinterpret_cast<const char*>(next);
  int64_t b = 0;  // the block's index: its share of the prefetch
  // One block (1-6 rows) reads the panel once: it streams kStreamAhead bytes ahead of
  // itself, into the next panel near its end; more blocks re-read it from L2, so each
  // prefetches its share of the next panel.
  const int64_t ahead = blocks == 1 ? kStreamAhead : 0;
  const auto block = [&](int64_t r, int64_t mr) {
    const c10::BFloat16* xb = x + r * ldx;
    OutT* yb = y + r * ldy;
    const char* pf = next && !ahead ? prefetch + 64 * std::min(b * lines, panel_lines) : nullptr;
    const int64_t pf_lines =
        pf ? std::max<int64_t>(std::min(lines, panel_lines - b * lines), 0) : 0;
    switch (mr) {
      case 6: micro_kernel<6, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
      case 5: micro_kernel<5, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
      case 4: micro_kernel<4, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
      case 3: micro_kernel<3, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
      case 2: micro_kernel<2, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
      default: micro_kernel<1, OutT>(xb, ldx, panel, pairs, bias, yb, ldy, cols, pf, pf_lines, ahead, prefetch); break;
    }
    ++b;
  };
  if (blocks == 2) {  // 7-12 rows: one pass over the panel, half of it at a time
    rows_times_half_panels(x, ldx, rows, panel, pairs, bias, y, ldy, cols, next);
    return;
  }
  if (blocks < 3) {  // 6 + the rest
    for (int64_t r = 0; r < rows; r += kRowBlock) block(r, std::min(kRowBlock, rows - r));
  } else {
    even_row_blocks(rows, kRowBlock, block);
  }
}
#endif

#if LOOM_HAVE_AMX
// AMX: the same panels feed the tile units. A tile of B is 16 pairs of input features
// by 16 outputs: 16 rows of 64 bytes, 256 bytes apart in a panel (its 64 outputs' pairs
// side by side), so loom's layout serves both kernels and no second copy is kept.
// One block is up to 32 rows x 32 outputs: C tiles 0-3 (rows 0-15 / 16-31 x outputs
// 0-15 / 16-31, float32), A tiles 4-5 (the rows' 32 input features), B tiles 6-7; each
// A and B tile loaded feeds two tile products. Up to 16 rows take one wide block
// (amx_block_wide) of all 64 outputs instead.
constexpr int64_t kAmxRows = 32;
constexpr int64_t kAmxCols = 32;

// Whether this process may use the tile registers: Linux grants them on request; a
// kernel or VM that does not leaves AMX off.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}
#endif

// The LOOM_AMX switch (loom/envs.py), set by the Python side when it loads the module.
std::atomic<bool> amx_wanted{true};

#if LOOM_HAVE_AMX

// The tile shapes for a block of m rows (1..32): C 0-3, A 4-5, B 6-7.
void configure_tiles(int64_t m, int64_t& configured) {
  const uint8_t m0 = static_cast<uint8_t>(std::min<int64_t>(m, 16));
  const uint8_t m1 = static_cast<uint8_t>(m - m0);
  amx::configure(m, configured, {m0, m0, m1, m1, m0, m1, 16, 16},
                 {64, 64, 64, 64, 64, 64, 64, 64});
}

// Rows [0, m) of the tiles' float32 sums (rows `ld` floats apart) into y's first `cols`
// outputs, rounded to bf16 as the AVX-512 kernel rounds them, or kept in float32.
template <typename OutT>
void store_tile_sums(const float* sums, int64_t ld, int64_t m, int64_t cols, OutT* y,
                     int64_t ldy) {
  for (int64_t v = 0; 16 * v < cols; ++v) {
    const int64_t left = cols - 16 * v;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    for (int64_t r = 0; r < m; ++r) {
      const __m512 acc = _mm512_load_ps(sums + r * ld + 16 * v);
      if constexpr (std::is_same_v<OutT, float>)
        _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask, acc);
      else
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(acc));
    }
  }
}

// Rows [0, m) (m <= 32) of x times outputs [c0, c0 + 32) of one panel, over all of K
// (pairs a multiple of 16): sums start from the bias, as the AVX-512 kernel's do, and
// are rounded as it rounds them. `prefetch` (or null): the next panel, requested into
// L2 a 16-pair share per step (a tile load that waits on memory holds up the tile
// products queued behind it).
template <typename OutT>
void amx_block(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* panel,
               int64_t pairs, int64_t c0, const float* bias, OutT* y, int64_t ldy,
               int64_t cols, int64_t& configured, const char* prefetch) {
  configure_tiles(m, configured);
  alignas(64) float sums[kAmxRows][kAmxCols];
  const bool lower = m > 16;
  if (bias) {
    for (int64_t r = 0; r < 16; ++r) std::memcpy(sums[r], bias + c0, sizeof(sums[r]));
    _tile_loadd(0, sums[0], sizeof(sums[0]));
    _tile_loadd(1, sums[0] + 16, sizeof(sums[0]));
    if (lower) {
      _tile_loadd(2, sums[0], sizeof(sums[0]));
      _tile_loadd(3, sums[0] + 16, sizeof(sums[0]));
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (lower) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const int64_t x_stride = ldx * 2;
  for (int64_t i = 0; i < pairs; i += 16) {
    const c10::BFloat16* b = panel + (i * kPanel + c0) * 2;
    if (prefetch) {  // 16 pairs of the next panel: 16 rows of 256 bytes
      for (int64_t line = 0; line < 64; ++line)
        _mm_prefetch(prefetch + i * kPanel * 4 + 64 * line, _MM_HINT_T1);
    }
    _tile_loadd(4, x + 2 * i, x_stride);
    _tile_loadd(6, b, kPanel * 4);
    _tile_loadd(7, b + 32, kPanel * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (lower) {
      _tile_loadd(5, x + 16 * ldx + 2 * i, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], sizeof(sums[0]));
  _tile_stored(1, sums[0] + 16, sizeof(sums[0]));
  if (lower) {
    _tile_stored(2, sums[16], sizeof(sums[0]));
    _tile_stored(3, sums[16] + 16, sizeof(sums[0]));
  }
  store_tile_sums(sums[0], kAmxCols, m, cols, y, ldy);
}

// Rows [0, m) (m <= 16) of x times all 64 outputs of one panel, over all of K: C tiles
// 0-3 (outputs 0-15 .. 48-63), A tile 4, B tiles 5-7 (the fourth B reuses 5). Each
// 16-pair step reads its panel rows' 256 bytes whole, so the panel streams from memory
// once, in order; two 32-output blocks read every other half of each row, in two passes
// (8 rows, a 1B model's layers: 22 GB/s against 26 at 1 row, on the 2-core AMX VM).
// Each step asks for the 4 KB kStreamAhead bytes ahead into L2, in this panel or the
// next (`next`, or null).
template <typename OutT>
void amx_block_wide(const c10::BFloat16* x, int64_t ldx, int64_t m,
                    const c10::BFloat16* panel, int64_t pairs, const float* bias, OutT* y,
                    int64_t ldy, int64_t cols, int64_t& configured, const char* next) {
  const uint8_t rows = static_cast<uint8_t>(m);
  const int64_t panel_bytes = pairs * kPanel * 4;
  amx::configure(64 + m, configured, {rows, rows, rows, rows, rows, 16, 16, 16},
                 {64, 64, 64, 64, 64, 64, 64, 64});
  alignas(64) float sums[16][kPanel];
  if (bias) {
    for (int64_t r = 0; r < 16; ++r) std::memcpy(sums[r], bias, sizeof(sums[r]));
    _tile_loadd(0, sums[0], sizeof(sums[0]));
    _tile_loadd(1, sums[0] + 16, sizeof(sums[0]));
    _tile_loadd(2, sums[0] + 32, sizeof(sums[0]));
    _tile_loadd(3, sums[0] + 48, sizeof(sums[0]));
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * 2;
  for (int64_t i = 0; i < pairs; i += 16) {
    const c10::BFloat16* b = panel + i * kPanel * 2;
    // the 4 KB kStreamAhead bytes on in the thread's stream
    const char* ahead = stream_at(panel, panel_bytes, i * kPanel * 4 + kStreamAhead, next);
    if (ahead) {
      for (int64_t line = 0; line < 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    }
    _tile_loadd(4, x + 2 * i, x_stride);
    _tile_loadd(5, b, kPanel * 4);
    _tile_loadd(6, b + 32, kPanel * 4);
    _tile_loadd(7, b + 64, kPanel * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, kPanel * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, sums[0], sizeof(sums[0]));
  _tile_stored(1, sums[0] + 16, sizeof(sums[0]));
  _tile_stored(2, sums[0] + 32, sizeof(sums[0]));
  _tile_stored(3, sums[0] + 48, sizeof(sums[0]));
  store_tile_sums(sums[0], kPanel, m, cols, y, ldy);
}

// All `rows` rows times one panel through the tiles: up to 16 rows in one wide block,
// more 32 rows x 32 outputs at a time;
// the first block prefetches the panel at `next` (or null). (Blocking K as well, to
// keep a block's weights in L1 across row blocks, measured slower: its sums must leave
// the tiles between K blocks.)
template <typename OutT>
void amx_rows_times_panel(const c10::BFloat16* x, int64_t ldx, int64_t rows,
                          const c10::BFloat16* panel, int64_t pairs, const float* bias,
                          OutT* y, int64_t ldy, int64_t cols, int64_t& configured,
                          const c10::BFloat16* next) {
  if (rows <= 16) {  // (17-32 rows as two such blocks measured 5-10% slower than 32 x 32)
    amx_block_wide(x, ldx, rows, panel, pairs, bias, y, ldy, std::min(cols, kPanel),
                   configured, reinterpret_cast<const char*>(next));
    return;
  }
  for (int64_t c0 = 0; c0 < std::min(cols, kPanel); c0 += kAmxCols)
    for (int64_t r = 0; r < rows; r += kAmxRows)
      amx_block(x + r * ldx, ldx, std::min(kAmxRows, rows - r), panel, pairs, c0, bias,
                y + r * ldy + c0, ldy, std::min(kAmxCols, cols - c0), configured,
                c0 == 0 && r == 0 ? reinterpret_cast<const char*>(next) : nullptr);
}
#endif

// bf16_linear's arguments: x (M, K) bf16, out (M, N) bf16 or float32, both with their
// last dim contiguous, packed from pack_bf16_weight for a weight (N, K).
void check_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(LOOM_HAVE_BF16_GEMM, "bf16_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
              x.stride(1) == 1, "x must be a 2-d bfloat16 CPU tensor, last dim contiguous");
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
              out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "out must be (rows of x, N) bfloat16 or float32, last dim contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2,
              "packed must come from pack_bf16_weight");
  const int64_t n = out.size(1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " features, the weight ", 2 * pairs);
  TORCH_CHECK(n <= panels * kPanel && n > (panels - 1) * kPanel, "out has ", n,
              " columns, the packed weight ", panels * kPanel);
}

#if LOOM_HAVE_BF16_GEMM
// How one matmul's rows are cut into work items: on the tiles or not, and equal chunks
// of whole row blocks, at most kMaxRowChunk rows each. A function of the matmul alone,
// so a matmul gives the same values run alone (bf16_linear) or in a group.
struct RowChunks {
  bool amx;
  int64_t chunks, chunk_rows;
};

RowChunks row_chunks(int64_t rows, int64_t pairs) {
  // The tiles from amx::kMinRows rows on.
  const bool amx = rows >= amx::kMinRows && pairs % 16 == 0 && bf16_amx_available();
  const int64_t block = amx ? 32 : kRowBlock;
  const int64_t chunks = (rows + kMaxRowChunk - 1) / kMaxRowChunk;
  const int64_t chunk_rows =
      chunks ? ((rows + chunks - 1) / chunks + block - 1) / block * block : 0;
  return {amx, chunks, chunk_rows};
}

// Matmuls [0, count) in one parallel region. Work item (matmul, chunk of rows, panel),
// panels inner and the matmuls one after another: with few rows each thread takes a
// contiguous run of panels, reads only its share of the weights, and prefetches the
// next item's panel, in the next matmul where its run crosses one.
template <typename OutT>
void run_matmuls(const Bf16Matmul* matmuls, int64_t count, const float* bias) {
  std::vector<RowChunks> cuts(count);
  std::vector<int64_t> first_item(count + 1, 0);  // matmul m's items: [first_item[m], ..[m+1])
  for (int64_t m = 0; m < count; ++m) {
    cuts[m] = row_chunks(matmuls[m].rows, matmuls[m].pairs);
    first_item[m + 1] = first_item[m] + cuts[m].chunks * matmuls[m].panels;
  }
  auto panel_of = [&](int64_t m, int64_t p) {
    return matmuls[m].packed + p * matmuls[m].pairs * kPanel * 2;
  };
  at::parallel_for(0, first_item[count], 1, [&](int64_t begin, int64_t end) {
    int64_t configured = -1;  // this thread's tile shapes, loaded by the first block
    int64_t m = std::upper_bound(first_item.begin(), first_item.end(), begin) -
                first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[m + 1]) ++m;
      const Bf16Matmul& job = matmuls[m];
      const int64_t local = item - first_item[m];
      const int64_t chunk = local / job.panels, p = local % job.panels;
      const int64_t r0 = chunk * cuts[m].chunk_rows;
      const int64_t nrows = std::min(cuts[m].chunk_rows, job.rows - r0);
      if (nrows <= 0) continue;
      const c10::BFloat16* next = nullptr;
      if (item + 1 < end) {
        const int64_t nm = item + 1 < first_item[m + 1] ? m : m + 1;
        next = panel_of(nm, (item + 1 - first_item[nm]) % matmuls[nm].panels);
      }
      const c10::BFloat16* x = job.x + r0 * job.ldx;
      OutT* y = static_cast<OutT*>(job.out) + r0 * job.ldy + p * kPanel;
      const float* b = bias ? bias + p * kPanel : nullptr;
      const int64_t cols = std::min(kPanel, job.n - p * kPanel);
#if LOOM_HAVE_AMX
      if (cuts[m].amx) {
        amx_rows_times_panel(x, job.ldx, nrows, panel_of(m, p), job.pairs, b, y, job.ldy,
                             cols, configured, next);
        continue;
      }
#endif
      rows_times_panel(x, job.ldx, nrows, panel_of(m, p), job.pairs, b, y, job.ldy, cols,
                       next);
    }
#if LOOM_HAVE_AMX
    amx::release(configured);
#endif
  });
}
#endif

}  // namespace

bool bf16_gemm_available() { return LOOM_HAVE_BF16_GEMM; }

bool bf16_amx_available() {
#if LOOM_HAVE_AMX
  // (batch invariance: the tiles round sums in another order than the AVX-512
  // micro-kernel, which 1-7 rows take)
  return amx_wanted.load(std::memory_order_relaxed) && !batch_invariant() && amx_permitted();
#else
  return false;
#endif
}

void set_bf16_amx(bool wanted) { amx_wanted.store(wanted, std::memory_order_relaxed); }

at::Tensor pack_bf16_weight(at::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
              weight.dim() == 2, "pack_bf16_weight takes a 2-d bfloat16 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "pack_bf16_weight needs an even number of input features, got ", k);
  const int64_t panels = (n + kPanel - 1) / kPanel, full = n / kPanel;
  // (N, K) -> (panels, 64, K/2, 2) -> (panels, K/2, 64, 2), the last panel zero-padded:
  // written straight into the result (no padded copy of the whole weight beside it: a
  // 1B model's 192 MiB table peaked at three copies)
  const at::Tensor plain = weight.contiguous();
  auto packed = at::empty({panels, k / 2, kPanel, 2}, weight.options());
  if (full > 0)
    packed.narrow(0, 0, full).copy_(
        plain.narrow(0, 0, full * kPanel).view({full, kPanel, k / 2, 2}).permute({0, 2, 1, 3}));
  if (panels > full) {
    auto last = at::zeros({kPanel, k}, weight.options());
    last.narrow(0, 0, n - full * kPanel).copy_(plain.narrow(0, full * kPanel, n - full * kPanel));
    packed.select(0, full).copy_(last.view({kPanel, k / 2, 2}).permute({1, 0, 2}));
  }
  return packed;
}

void bf16_gather_rows(at::Tensor out, at::Tensor packed, at::Tensor ids, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2,
              "packed must come from pack_bf16_weight");
  const int64_t pairs = packed.size(1), rows = ids.numel();
  TORCH_CHECK(n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel,
              "the packed weight has ", packed.size(0) * kPanel, " rows, not ", n);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.is_cpu(),
              "ids must be a contiguous int64 CPU tensor");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == rows && out.size(1) == 2 * pairs,
              "out must be a contiguous (", rows, ", ", 2 * pairs, ") bfloat16 tensor");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < n, "row id ", id[r], " is outside [0, ", n, ")");
  // A row is one 4-byte pair every kPanel * 4 bytes of its panel.
  const auto* src = reinterpret_cast<const int32_t*>(packed.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<int32_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* from = src + (id[r] / kPanel) * pairs * kPanel + id[r] % kPanel;
      int32_t* to = dst + r * pairs;
      for (int64_t i = 0; i < pairs; ++i) to[i] = from[i * kPanel];
    }
  });
}

void bf16_linear(at::Tensor out, at::Tensor x, at::Tensor packed,
                 c10::optional<at::Tensor> bias) {
  check_matmul(out, x, packed);
  const int64_t rows = x.size(0), n = out.size(1), pairs = packed.size(1);
  const int64_t panels = packed.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " entries");
    bias_f = at::zeros({panels * kPanel}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  if (rows == 0) return;
#if LOOM_HAVE_BF16_GEMM
  const Bf16Matmul job{x.data_ptr<c10::BFloat16>(), x.stride(0), rows,
                       packed.data_ptr<c10::BFloat16>(), pairs, panels,
                       out.data_ptr(), out.stride(0), n};
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat)
    run_matmuls<float>(&job, 1, bp);
  else
    run_matmuls<c10::BFloat16>(&job, 1, bp);
#endif
}

Bf16Matmul bf16_matmul(at::Tensor out, at::Tensor x, at::Tensor packed) {
  check_matmul(out, x, packed);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "a group's outputs are bfloat16");
  return {x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0),
          packed.data_ptr<c10::BFloat16>(), packed.size(1), packed.size(0),
          out.data_ptr(), out.stride(0), out.size(1)};
}

void bf16_linear_group(const std::vector<Bf16Matmul>& matmuls) {
  TORCH_CHECK(LOOM_HAVE_BF16_GEMM, "bf16_linear_group needs a CPU with AVX512-BF16");
  for (const auto& m : matmuls)
    TORCH_CHECK(m.n <= m.panels * kPanel && m.n > (m.panels - 1) * kPanel && m.rows >= 0,
                "bf16_linear_group: a matmul of ", m.n, " outputs on ", m.panels, " panels");
#if LOOM_HAVE_BF16_GEMM
  run_matmuls<c10::BFloat16>(matmuls.data(), static_cast<int64_t>(matmuls.size()), nullptr);
#endif
}

}  // namespace loom
