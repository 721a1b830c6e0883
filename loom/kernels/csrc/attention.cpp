// Paged attention: causal attention of each request's new queries over its whole context, read in
// place from the paged cache (the new tokens' K/V must already be written).
//
// query (T, H, D) rows strided, last dim contiguous; out (T, H, D) contiguous;
// block_table (B, W) int32; seq_lens (B,) int32 (context length after this step);
// query_start_loc (B + 1,) int32. Query j of request b sits at position
// seq_lens[b] - q_len + j and sees keys 0 .. that position; with a sliding window W > 0
// (paged_attention_windowed) only the last W of them, itself included.
//
// Work is split into items (request, KV head, tile of up to kTile query tokens);
// an item's G * tile query rows share each K/V row it loads. Scores and softmax
// in float32, the output rounded once: the generic kernel in two passes over the keys,
// the bf16 one (AVX512-BF16) over blocks of 512 keys at fixed places with flash
// attention's running max and sum, so a long context's scores never leave L2.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

namespace loom {
namespace {

// Decode attention reads each request's K and V from blocks scattered over the
// cache, mostly from DRAM: one miss after another they cost 3x the arithmetic. While
// one item computes, this asks for the next item's K/V rows (into L2) a slice per
// 16 keys, spread out so the requests overlap the arithmetic instead of stalling it:
// over the item's q.k and its weighted sum of V both (steps: twice its 16-key runs).
// Over q.k alone, a 1B batch-32 step's attention took 0.65-0.68 ms a layer; over both
// 0.48-0.55 (2 threads, 192-token contexts, benchmarks/quantized.md).
class BlockPrefetcher {
 public:
  void reset(const char* cache, const int32_t* blocks, int64_t num_keys, int64_t kv_head,
             int64_t kv_heads, int64_t num_slots, int64_t block_size, int64_t row_bytes,
             int64_t steps) {
    keys_ = cache + kv_head * num_slots * row_bytes;
    values_ = cache + (kv_heads + kv_head) * num_slots * row_bytes;
    blocks_ = blocks;
    block_bytes_ = block_size * row_bytes;
    num_blocks_ = (num_keys + block_size - 1) / block_size;
    last_block_bytes_ = (num_keys - (num_blocks_ - 1) * block_size) * row_bytes;
    const int64_t requests = (num_keys * row_bytes + kStride - 1) / kStride;
    per_step_ = (requests + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1);
    block_ = 0;
    offset_ = 0;
  }
  void clear() { num_blocks_ = 0; block_ = 0; }
  // The next per_step_ requests, each for K and for V.
  void step() {
    int64_t left = per_step_, block = block_, offset = offset_;
    while (left > 0 && block < num_blocks_) {
      const int64_t at = static_cast<int64_t>(blocks_[block]) * block_bytes_;
      const int64_t end = block + 1 < num_blocks_ ? block_bytes_ : last_block_bytes_;
      for (; offset < end && left > 0; offset += kStride, --left) {
        __builtin_prefetch(keys_ + at + offset, 0, 2);
        __builtin_prefetch(values_ + at + offset, 0, 2);
      }
      if (offset >= end) {
        offset = 0;
        ++block;
      }
    }
    block_ = block;
    offset_ = offset;
  }

 private:
  static constexpr int64_t kStride = 64;  // a cache line (every 2nd line: 1.5x slower cold)
  const char* keys_ = nullptr;
  const char* values_ = nullptr;
  const int32_t* blocks_ = nullptr;
  int64_t block_bytes_ = 0, last_block_bytes_ = 0, num_blocks_ = 0;
  int64_t per_step_ = 0, block_ = 0, offset_ = 0;
};

constexpr int64_t kTile = 16;
constexpr int64_t kSerialWork = 1 << 13;  // rows x keys below which one thread runs it all

#if defined(__AVX2__) && defined(__FMA__)
// Lane i of the result is the sum of a[i]'s 8 lanes.
inline __m256 reduce8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // u0: keys 0-3's sums of lanes 0-3 | of lanes 4-7; u1: keys 4-7's
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc (rows R, D) += p (R rows of weights at stride ld) times v (n rows of D floats):
// 16 columns at a time, the R x 16 sums in registers over the n rows. A product and a
// sum, not an FMA: the per-key path's roundings (with FMAs the default file's top-1
// agreement with float32 moved 99.35% -> 98.85%, below the test's 99%: near-ties that
// flip with any change of rounding; this order gives 99.05%).
template <int R>
inline void add_weighted_rows(float* acc, int64_t head_dim, const float* p, int64_t ld,
                              const float* v, int64_t n) {
  for (int64_t c = 0; c < head_dim; c += 16) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) a[r][h] = _mm256_loadu_ps(acc + r * head_dim + c + 8 * h);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 v0 = _mm256_loadu_ps(v + i * head_dim + c);
      const __m256 v1 = _mm256_loadu_ps(v + i * head_dim + c + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * ld + i);
        a[r][0] = _mm256_add_ps(a[r][0], _mm256_mul_ps(w, v0));
        a[r][1] = _mm256_add_ps(a[r][1], _mm256_mul_ps(w, v1));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * head_dim + c + 8 * h, a[r][h]);
  }
}
#endif

// One row of scores -> exp(s - max) in place; returns 1 / their sum (8 lanes at a time
// with AVX2: the scalar exp's bits, the sum in another order).
inline float softmax_row(float* s, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
  for (int64_t p = 0; p < n; ++p) max = std::max(max, s[p]);
  float sum = 0.f;
  int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 top = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  for (; p + 8 <= n; p += 8) {
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), top));
    _mm256_storeu_ps(s + p, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
  for (; p < n; ++p) {
    s[p] = fast_exp(s[p] - max);
    sum += s[p];
  }
  return 1.f / sum;
}

template <typename T>
void attention_item(T* out, const T* query, const T* keys, const T* values,
                    const int32_t* blocks, int64_t q_stride0, int64_t q_stride1,
                    int64_t kv_heads, int64_t block_size, int64_t head_dim, int64_t group,
                    int64_t kv_head,
                    int64_t first_token, int64_t q_len, int64_t context, int64_t j0, int64_t j1,
                    float scale, int64_t window, std::vector<float>& buf,
                    BlockPrefetcher& prefetcher) {
  const int64_t rows = (j1 - j0) * group;
  const int64_t past = context - q_len;  // keys before the first new token
  const int64_t num_keys = past + j1;    // the tile's last query sees keys [0, past + j1)
  buf.resize(rows * head_dim * 2 + rows * num_keys + 2 * head_dim);
  float* q = buf.data();                 // (rows, D)
  float* acc = q + rows * head_dim;      // (rows, D)
  float* scores = acc + rows * head_dim; // (rows, num_keys)
  float* row_f = scores + rows * num_keys;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t g = 0; g < group; ++g)
      load_row(query + (first_token + j) * q_stride0 + (kv_head * group + g) * q_stride1,
               q + ((j - j0) * group + g) * head_dim, head_dim);
  // Keys before the tile's first window are never read: their blocks may be back in
  // the pool (KVCacheManager frees blocks every window has left behind).
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, past + j0 + 1 - window) : 0;

  // Row r sees keys [lo[r], hi[r]): its own position and the ones before, within the
  // window. Keys are walked block by block (no division per key).
  std::vector<int64_t> lo(rows), hi(rows);
  for (int64_t r = 0; r < rows; ++r) {
    hi[r] = past + j0 + r / group + 1;
    lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window) : 0;
  }
  auto for_each_key = [&](int64_t from, auto&& f) {
    for (int64_t p = from; p < num_keys;) {
      const int64_t block = p / block_size, end = std::min(num_keys, (block + 1) * block_size);
      const int64_t slot0 = static_cast<int64_t>(blocks[block]) * block_size - block * block_size;
      for (; p < end; ++p) f(p, slot0 + p);
    }
  };
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < first_key; ++p) scores[r * num_keys + p] = kMinusInf;
  // AVX2 (and what head sizes allow): a cache block's keys (then values) converted to
  // float32 once into `block_f`, 8 keys' q.k at a time for a row (8 sums, one transpose
  // and add), and the weighted sum of V with a 4-row x 16-column tile of sums in
  // registers. A dot per key (its own horizontal sum) and a load-add-store per row and
  // value made the per-key path 3-4x the arithmetic (benchmarks/quantized.md).
  [[maybe_unused]] bool blocked = false;
#if defined(__AVX2__) && defined(__FMA__)
  blocked = head_dim % 16 == 0;
  std::vector<float> block_f(blocked ? (block_size + 7) / 8 * 8 * head_dim : 0);
  float* kb = block_f.data();
  // f(first key, keys, their first slot): the walk of for_each_key, a block at a time
  auto for_each_block = [&](auto&& f) {
    for (int64_t p = first_key; p < num_keys;) {
      const int64_t block = p / block_size, end = std::min(num_keys, (block + 1) * block_size);
      f(p, end - p, static_cast<int64_t>(blocks[block]) * block_size + p - block * block_size);
      p = end;
    }
  };
  if (blocked)
    for_each_block([&](int64_t p0, int64_t n, int64_t slot) {
      for (int64_t i = 0; i < n; i += 16) prefetcher.step();  // (the next item's K/V)
      for (int64_t i = 0; i < n; ++i) load_row(keys + (slot + i) * head_dim, kb + i * head_dim, head_dim);
      std::fill(kb + n * head_dim, kb + (n + 7) / 8 * 8 * head_dim, 0.f);
      const __m256 sc = _mm256_set1_ps(scale);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores + r * num_keys;
        for (int64_t i0 = 0; i0 < n; i0 += 8) {
          __m256 a[8];
          for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
          for (int64_t c = 0; c < head_dim; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + r * head_dim + c);
            for (int i = 0; i < 8; ++i)
              a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kb + (i0 + i) * head_dim + c), a[i]);
          }
          const __m256 v = _mm256_mul_ps(reduce8(a), sc);
          const int64_t p = p0 + i0, count = std::min<int64_t>(8, n - i0);
          if (count == 8 && p >= lo[r] && p + 8 <= hi[r]) {
            _mm256_storeu_ps(s + p, v);
          } else {
            alignas(32) float t[8];
            _mm256_store_ps(t, v);
            for (int64_t i = 0; i < count; ++i)
              s[p + i] = p + i >= lo[r] && p + i < hi[r] ? t[i] : kMinusInf;
          }
        }
      }
    });
#endif
  if (!blocked)
    for_each_key(first_key, [&](int64_t p, int64_t slot) {
      load_row(keys + slot * head_dim, row_f, head_dim);
      for (int64_t r = 0; r < rows; ++r)
        scores[r * num_keys + p] = p >= lo[r] && p < hi[r]
                                       ? dot(q + r * head_dim, row_f, head_dim) * scale
                                       : kMinusInf;
    });
  std::vector<float> inv_sum(rows);
  for (int64_t r = 0; r < rows; ++r) inv_sum[r] = softmax_row(scores + r * num_keys, num_keys);
  std::fill(acc, acc + rows * head_dim, 0.f);
#if defined(__AVX2__) && defined(__FMA__)
  if (blocked)
    for_each_block([&](int64_t p0, int64_t n, int64_t slot) {
      for (int64_t i = 0; i < n; i += 16) prefetcher.step();
      for (int64_t i = 0; i < n; ++i) load_row(values + (slot + i) * head_dim, kb + i * head_dim, head_dim);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        add_weighted_rows<4>(acc + r * head_dim, head_dim, scores + r * num_keys + p0, num_keys, kb, n);
      const float* pr = scores + r * num_keys + p0;
      if (rows - r == 3) add_weighted_rows<3>(acc + r * head_dim, head_dim, pr, num_keys, kb, n);
      if (rows - r == 2) add_weighted_rows<2>(acc + r * head_dim, head_dim, pr, num_keys, kb, n);
      if (rows - r == 1) add_weighted_rows<1>(acc + r * head_dim, head_dim, pr, num_keys, kb, n);
    });
#endif
  if (!blocked)
    for_each_key(first_key, [&](int64_t p, int64_t slot) {
      load_row(values + slot * head_dim, row_f, head_dim);
      for (int64_t r = 0; r < rows; ++r) {
        const float w = scores[r * num_keys + p];
        if (w == 0.f) continue;
        float* a = acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row_f[d];
      }
    });
  const int64_t heads = kv_heads * group;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (j - j0) * group + g;
      T* o = out + ((first_token + j) * heads + kv_head * group + g) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d)
        o[d] = from_float<T>(acc[r * head_dim + d] * inv_sum[r]);
    }
}

#if LOOM_HAVE_AVX512_BF16
// Sixteen rows of 16 dwords in r[0..15] -> r[m] lane i holds row i's dword m.
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane l: rows 2i, 2i+1 at 4l..4l+1 | 4l+2..4l+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e] lane l: rows 4i..4i+3 at dword 4l + e
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i b = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i c = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(3, 1, 3, 1));
    t[e] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));       // dword e
    t[8 + e] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));   // dword 8 + e
    t[4 + e] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));   // dword 4 + e
    t[12 + e] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));  // dword 12 + e
  }
  for (int m = 0; m < 16; ++m) r[m] = t[m];
}

// Keys rows[0..15] (VC * 16 bf16 each) as VC * 8 vectors: out[m] lane i holds key i's
// bf16 pair m (dims 2m, 2m + 1), the operand vdpbf16ps pairs with a query's pair m.
template <int VC>
inline void transpose_keys(__m512i* out, const c10::BFloat16* const* rows) {
  for (int part = 0; part < VC / 2; ++part) {  // 32 dims (16 pairs) at a time
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + 32 * part);
    transpose16x16_epi32(r);
    for (int m = 0; m < 16; ++m) out[16 * part + m] = r[m];
  }
}

// Scores of NR query rows (bf16, VC * 8 pairs each at q + r * q_stride) against 16 * KC
// keys transposed (kt: keys 0-15, then 16-31, ...): lane i of sum[r][k] = q_r . key
// 16k + i, the pairs summed in order by vdpbf16ps, a query pair broadcast against 16
// keys' pairs. NR x KC independent chains: 12 or more cover vdpbf16ps's latency.
template <int VC, int NR, int KC>
inline void score_keys(__m512 (&sum)[NR][KC], const uint16_t* q, int64_t q_stride,
                       const __m512i* kt) {
  constexpr int M = VC * 8;
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < KC; ++k) sum[r][k] = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    __m512bh keys[KC];
    for (int k = 0; k < KC; ++k) keys[k] = (__m512bh)kt[k * M + m];
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * q_stride + 2 * m, sizeof(pair));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int k = 0; k < KC; ++k) sum[r][k] = _mm512_dpbf16_ps(sum[r][k], w, keys[k]);
    }
  }
}

// Values p, p + 1 of a chunk of keys interleaved as vdpbf16ps takes them: for each of the
// row's C 32-dim parts, unpack{lo,hi}_epi16 of the two rows (dims permuted within
// 128-bit lanes; unpermute_sums puts them back). out: per key pair, C lo then C hi.
template <int VC>
inline void pack_value_pairs(__m512i* out, const c10::BFloat16* const* value_rows,
                             int64_t pairs) {
  constexpr int C = VC / 2;
  for (int64_t i = 0; i < pairs; ++i, out += 2 * C)
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(value_rows[2 * i] + 32 * c);
      const __m512i b = _mm512_loadu_si512(value_rows[2 * i + 1] + 32 * c);
      out[c] = _mm512_unpacklo_epi16(a, b);
      out[C + c] = _mm512_unpackhi_epi16(a, b);
    }
}

// sums[r] += sum_p w[r][p] * V[p] over a run of keys for R rows, in registers within
// the run. The weights are bf16 (`probs`, zero past the last key), keys taken in pairs:
// a broadcast pair of weights times the pair's values, which pair_of(i, lo, hi) gives
// interleaved (pack_value_pairs' layout). sums: per row, C lo then C hi vectors of 16
// floats, dims permuted as packed; the float32 sums run over the keys in order, run
// after run.
template <int VC, int R, typename PairOf>
inline void weighted_values(float* sums, const uint16_t* probs, int64_t probs_stride,
                            int64_t pairs, PairOf&& pair_of) {
  constexpr int C = VC / 2;
  __m512 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      lo[r][c] = _mm512_loadu_ps(sums + (r * 2 * C + c) * 16);
      hi[r][c] = _mm512_loadu_ps(sums + (r * 2 * C + C + c) * 16);
    }
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh vlo[C], vhi[C];
    pair_of(i, vlo, vhi);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, probs + r * probs_stride + 2 * i, sizeof(pair));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], w, vlo[c]);
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], w, vhi[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(sums + (r * 2 * C + c) * 16, lo[r][c]);
      _mm512_storeu_ps(sums + (r * 2 * C + C + c) * 16, hi[r][c]);
    }
}

// weighted_values over a chunk's values packed in memory (pack_value_pairs), read by
// every pass of R rows.
template <int VC, int R>
inline void weighted_values_chunk(float* sums, const uint16_t* probs, int64_t probs_stride,
                                  const __m512i* packed, int64_t pairs) {
  constexpr int C = VC / 2;
  weighted_values<VC, R>(sums, probs, probs_stride, pairs,
                         [&](int64_t i, __m512bh* lo, __m512bh* hi) {
                           for (int c = 0; c < C; ++c) {
                             lo[c] = (__m512bh)_mm512_load_si512(packed + 2 * C * i + c);
                             hi[c] = (__m512bh)_mm512_load_si512(packed + 2 * C * i + C + c);
                           }
                         });
}

// weighted_values over a block's keys, each pair of values packed in registers as it is
// read: the same sums, for an item whose rows are one pass (a decode), where packing
// into memory first would only add stores and loads.
template <int VC, int R>
inline void weighted_values_direct(float* sums, const uint16_t* probs, int64_t probs_stride,
                                   const c10::BFloat16* const* value_rows, int64_t pairs,
                                   BlockPrefetcher& prefetcher) {
  constexpr int C = VC / 2;
  weighted_values<VC, R>(sums, probs, probs_stride, pairs,
                         [&](int64_t i, __m512bh* lo, __m512bh* hi) {
                           if (i % 8 == 0) prefetcher.step();
                           for (int c = 0; c < C; ++c) {
                             const __m512i a = _mm512_loadu_si512(value_rows[2 * i] + 32 * c);
                             const __m512i b = _mm512_loadu_si512(value_rows[2 * i + 1] + 32 * c);
                             lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                             hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
                           }
                         });
}

// A row's sums (as weighted_values leaves them) put back in dims' order, in place.
template <int VC>
inline void unpermute_sums(float* sums) {
  constexpr int C = VC / 2;
  // lane i of lo holds dim 8(i/4) + i%4 of its part, of hi dim 8(i/4) + 4 + i%4
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 lo[C], hi[C];
  for (int c = 0; c < C; ++c) {
    lo[c] = _mm512_loadu_ps(sums + c * 16);
    hi[c] = _mm512_loadu_ps(sums + (C + c) * 16);
  }
  for (int c = 0; c < C; ++c) {
    _mm512_storeu_ps(sums + 32 * c, _mm512_permutex2var_ps(lo[c], first, hi[c]));
    _mm512_storeu_ps(sums + 32 * c + 16, _mm512_permutex2var_ps(lo[c], second, hi[c]));
  }
}

// Per thread: an item's rows' largest scores so far (16 lanes each).
inline std::vector<__m512>& row_max_scratch() {
  static thread_local std::vector<__m512> scratch;
  return scratch;
}

// The bf16 item with AVX512-BF16: q.k with vdpbf16ps (a query's bf16 pair broadcast
// against 16 keys' pairs, transposed once per 16 keys for all the item's rows; float32
// sums over the pairs in order), probabilities rounded to bf16 (as Hugging Face's eager
// attention casts them) and multiplied into V with vdpbf16ps too: V packed in pairs once
// per chunk of keys, every row's float32 sums running over the keys in order. head_dim
// is 32, 64 or 128. The sums of a row depend on its own position and keys only, never
// on the item's other rows (greedy batch invariance).
template <int VC>  // head_dim / 16
void attention_item_bf16(c10::BFloat16* out, const c10::BFloat16* query,
                         const c10::BFloat16* keys, const c10::BFloat16* values,
                         const int32_t* blocks, int64_t q_stride0, int64_t q_stride1,
                         int64_t kv_heads, int64_t block_size, int64_t group, int64_t kv_head,
                         int64_t first_token, int64_t q_len, int64_t context, int64_t j0,
                         int64_t j1, float scale, int64_t window, std::vector<float>& buf,
                         std::vector<const c10::BFloat16*>& rows_ptr,
                         BlockPrefetcher& prefetcher) {
  constexpr int64_t head_dim = VC * 16;
  constexpr int R = 16 / VC;  // rows per pass of the V sum
  constexpr int C = VC / 2;   // 32-dim parts of a row
  constexpr int64_t kChunk = 128;  // keys whose packed values a pass of the V sum reads
  constexpr int64_t kBlock = 512;  // keys whose scores are held at once
  const int64_t rows = (j1 - j0) * group;
  const int64_t padded_rows = (rows + R - 1) / R * R;
  const int64_t past = context - q_len;
  const int64_t num_keys = past + j1;
  const int64_t key_stride = (num_keys + 31) / 32 * 32;
  buf.resize(padded_rows * head_dim + padded_rows * kBlock + padded_rows * head_dim / 2 +
             padded_rows * kBlock / 2 + kChunk * head_dim / 2 + 2 * padded_rows + 32);
  float* acc = buf.data();                                     // (padded_rows, D)
  float* scores = acc + padded_rows * head_dim;                // (padded_rows, kBlock)
  auto* q = reinterpret_cast<uint16_t*>(scores + padded_rows * kBlock);  // (padded_rows, D)
  auto* probs = q + padded_rows * head_dim;                    // (padded_rows, kBlock)
  float* row_top = reinterpret_cast<float*>(probs + padded_rows * kBlock);  // m: max so far
  float* row_sum = row_top + padded_rows;                      // l: sum of exp(s - m) so far
  // the chunk's packed values, 64-byte aligned
  auto* packed = reinterpret_cast<__m512i*>(
      (reinterpret_cast<uintptr_t>(row_sum + padded_rows) + 63) & ~uintptr_t{63});
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(q + r * head_dim,
                query + (first_token + j0 + r / group) * q_stride0 +
                    (kv_head * group + r % group) * q_stride1,
                head_dim * sizeof(c10::BFloat16));
  std::fill(q + rows * head_dim, q + padded_rows * head_dim, uint16_t{0});
  rows_ptr.resize(2 * key_stride);
  const c10::BFloat16** key_rows = rows_ptr.data();
  const c10::BFloat16** value_rows = key_rows + key_stride;
  for (int64_t p = 0, b = 0; p < num_keys; ++b) {
    const int64_t first = static_cast<int64_t>(blocks[b]) * block_size;
    for (int64_t i = 0; i < block_size && p < num_keys; ++i, ++p) {
      key_rows[p] = keys + (first + i) * head_dim;
      value_rows[p] = values + (first + i) * head_dim;
    }
  }
  for (int64_t p = num_keys; p < key_stride; ++p) {  // the tail repeats the last key
    key_rows[p] = key_rows[num_keys - 1];
    value_rows[p] = value_rows[num_keys - 1];
  }
  // Keys before the tile's first window (masked below) repeat the last key too: their
  // blocks may be back in the pool (KVCacheManager frees blocks every window has left).
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, past + j0 + 1 - window) : 0;
  for (int64_t p = 0; p < first_key; ++p) {
    key_rows[p] = key_rows[num_keys - 1];
    value_rows[p] = value_rows[num_keys - 1];
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // keys [0, visible) of row r, within the window; each row's largest score kept
  std::vector<__m512>& row_max = row_max_scratch();
  int64_t b0 = 0;  // the block's first key
  auto store_scores = [&](int64_t r, int64_t p0, __m512 sum) {
    const int64_t visible = past + j0 + r / group + 1;
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(p0)));
    __mmask16 hidden = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(visible)));
    if (window > 0)  // and keys [0, visible - window) outside the window
      hidden |= _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(visible - window)));
    const __m512 s = _mm512_mask_mov_ps(_mm512_mul_ps(sum, sc), hidden, neg_inf);
    row_max[r] = _mm512_max_ps(row_max[r], s);
    _mm512_storeu_ps(scores + r * kBlock + p0 - b0, s);
  };
  // Keys 128 at a time (then 64, 32 for the tail), transposed once for all the rows,
  // which take them 8, 4, 3, 2 or 1 at a time, as many keys as keep 12-16 chains going.
  constexpr int M = VC * 8;
  alignas(64) __m512i kt[8 * M];
  auto run_rows = [&](int64_t p0, auto width_keys) {
    constexpr int W = decltype(width_keys)::value / 16;  // 16-key chunks in kt
    int64_t r = 0;
    auto rows_of = [&](auto nr, auto kc) {
      constexpr int NR = decltype(nr)::value;
      constexpr int KC = decltype(kc)::value < W ? decltype(kc)::value : W;
      for (; r + NR <= rows; r += NR)
        for (int k0 = 0; k0 < W; k0 += KC) {
          __m512 sum[NR][KC];
          score_keys<VC, NR, KC>(sum, q + r * head_dim, head_dim, kt + k0 * M);
          for (int i = 0; i < NR; ++i)
            for (int k = 0; k < KC; ++k) store_scores(r + i, p0 + 16 * (k0 + k), sum[i][k]);
        }
    };
    using std::integral_constant;
    rows_of(integral_constant<int, 8>{}, integral_constant<int, 2>{});
    rows_of(integral_constant<int, 4>{}, integral_constant<int, 4>{});
    rows_of(integral_constant<int, 3>{}, integral_constant<int, 4>{});
    rows_of(integral_constant<int, 2>{}, integral_constant<int, 8>{});
    rows_of(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  };
  // While a block's keys are scored, its values (read next, by the V sum) and the next
  // block's keys come into L2: a decode over a long context otherwise waits on memory
  // block by block (the blocks lie anywhere in the pool).
  auto prefetch_rows = [&](const c10::BFloat16* const* rows_at, int64_t count) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t line = 0; line < head_dim * 2; line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(rows_at[i]) + line, 0, 2);
  };
  auto pass = [&](int64_t p0, auto width_keys) {
    constexpr int W = decltype(width_keys)::value / 16;
    for (int k = 0; k < W; ++k) {
      prefetcher.step();
      const int64_t at = p0 + 16 * k;
      prefetch_rows(value_rows + at, 16);
      if (at + kBlock < key_stride) prefetch_rows(key_rows + at + kBlock, std::min<int64_t>(16, key_stride - at - kBlock));
      transpose_keys<VC>(kt + k * M, key_rows + at);
    }
    run_rows(p0, width_keys);
  };
  // Blocks of kBlock keys at fixed places (0, kBlock, ...): a row's sums depend on its
  // own keys only, however its tokens were split into steps and tiles. Per block: the
  // scores, the row's running max m and sum l (flash attention's online softmax, in
  // float32), exp(s - m) rounded to bf16 times V added to sums rescaled by exp(m_old - m).
  float* sums = acc;  // (as weighted_values keeps them)
  std::fill(sums, sums + padded_rows * head_dim, 0.f);
  std::fill(row_top, row_top + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);
  std::fill(probs + rows * kBlock, probs + padded_rows * kBlock, uint16_t{0});
  for (b0 = first_key / kBlock * kBlock; b0 < key_stride; b0 += kBlock) {
    const int64_t end = std::min(b0 + kBlock, key_stride);
    row_max.assign(rows, neg_inf);
    int64_t p0 = b0;
    for (; p0 + 128 <= end; p0 += 128) pass(p0, std::integral_constant<int, 128>{});
    if (p0 + 64 <= end) {
      pass(p0, std::integral_constant<int, 64>{});
      p0 += 64;
    }
    if (p0 < end) pass(p0, std::integral_constant<int, 32>{});
    const int64_t n = end - b0;  // a multiple of 32
    for (int64_t r = 0; r < rows; ++r) {
      const float top = std::max(row_top[r], _mm512_reduce_max_ps(row_max[r]));
      float* s = scores + r * kBlock;
      uint16_t* pr = probs + r * kBlock;
      if (top == -std::numeric_limits<float>::infinity()) {  // no key of the row here yet
        std::fill(pr, pr + n, uint16_t{0});
        continue;
      }
      const float rescale = fast_exp(row_top[r] - top);  // 0 for the row's first keys
      row_top[r] = top;
      const __m512 max = _mm512_set1_ps(top);
      __m512 total = _mm512_setzero_ps();
      for (int64_t p = 0; p < n; p += 16) {
        const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), max));
        total = _mm512_add_ps(total, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + p), float_to_bf16x16(e));
      }
      row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(total);
      if (rescale != 1.f) {
        const __m512 by = _mm512_set1_ps(rescale);
        float* a = sums + r * head_dim;
        for (int64_t d = 0; d < head_dim; d += 16)
          _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), by));
      }
    }
    const int64_t value_end = std::min(end, (num_keys + 1) / 2 * 2);
    if (padded_rows == R)
      weighted_values_direct<VC, R>(sums, probs, kBlock, value_rows + b0,
                                    (value_end - b0) / 2, prefetcher);
    else
      for (int64_t c0 = b0; c0 < value_end; c0 += kChunk) {
        const int64_t count = std::min(kChunk, value_end - c0);
        for (int64_t i = 0; i < count; i += 16) prefetcher.step();
        pack_value_pairs<VC>(packed, value_rows + c0, count / 2);
        for (int64_t r = 0; r < padded_rows; r += R)
          weighted_values_chunk<VC, R>(sums + r * head_dim, probs + r * kBlock + c0 - b0,
                                       kBlock, packed, count / 2);
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    unpermute_sums<VC>(acc + r * head_dim);
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
    float* a = acc + r * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), inv));
  }
  const int64_t heads = kv_heads * group;
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* o = out + ((first_token + j0 + r / group) * heads + kv_head * group + r % group) * head_dim;
    const float* a = acc + r * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) o[d] = from_float<c10::BFloat16>(a[d]);
  }
}
#endif

// Rows first .. num_keys - 1 of one head's keys (or values), read through the request's
// `blocks` from `rows` (rows of row_bytes: quantized values with their scale in a
// quantized `format`, else bf16) into `out` (num_keys, head_dim) in the query's dtype T.
template <typename T>
void convert_rows(const char* rows, int64_t row_bytes, const int32_t* blocks,
                  int64_t block_size, int64_t first, int64_t num_keys, KvFormat format, T* out,
                  int64_t head_dim) {
  for (int64_t p = first; p < num_keys; ++p) {
    const int64_t slot = static_cast<int64_t>(blocks[p / block_size]) * block_size + p % block_size;
    const char* row = rows + slot * row_bytes;
    T* dst = out + p * head_dim;
    if (format != KvFormat::kNone) {
      dequantize_kv_row(row, dst, head_dim, format);
    } else {
      const auto* src = reinterpret_cast<const c10::BFloat16*>(row);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(to_float(src[d]));
    }
  }
}

}  // namespace

// Requests with more than max_query_len new tokens are skipped (their rows of out
// are left as they are), for the caller to run with a prefill kernel.
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor seq_lens,
                     at::Tensor query_start_loc, double scale, int64_t max_query_len) {
  paged_attention_windowed(out, query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                           max_query_len, 0);
}

// As paged_attention, each query seeing only the last sliding_window keys up to its own
// position (0: all of them).
void paged_attention_windowed(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                              at::Tensor block_table, at::Tensor seq_lens,
                              at::Tensor query_start_loc, double scale, int64_t max_query_len,
                              int64_t sliding_window) {
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous 5-d");
  // A quantized cache (int8 or fp8: rows of head_dim values and their scale, common.h),
  // or a bf16 one under a float32 model, is read in the query's dtype: each item's keys
  // converted once, then attended to as a cache in that dtype would be.
  const KvFormat format = kv_format(kv_cache.scalar_type());
  const bool quantized = format != KvFormat::kNone;
  const bool converted = quantized || (query.scalar_type() == at::kFloat &&
                                       kv_cache.scalar_type() == at::kBFloat16);
  TORCH_CHECK(out.scalar_type() == query.scalar_type() &&
              (converted || query.scalar_type() == kv_cache.scalar_type()),
              "query/out/kv_cache dtypes differ");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be (T, H, D), last dim contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous, shaped as query");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt, "block_table, seq_lens, query_start_loc must be int32");
  block_table = block_table.contiguous();
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(3);
  const int64_t row = kv_cache.size(4), num_slots = kv_cache.size(2) * block_size;
  const int64_t head_dim = quantized ? row - kKvScaleBytes : row;
  const int64_t heads = query.size(1), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && query.size(2) == head_dim, "head counts/dims do not match");
  seq_lens = seq_lens.contiguous();
  query_start_loc = query_start_loc.contiguous();
  const int64_t num_reqs = seq_lens.size(0), width = block_table.size(1);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_table.size(0) == num_reqs,
              "query_start_loc must have one more entry than seq_lens and block_table rows");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();

  struct Item { int64_t req, kv_head, j0, j1; };
  std::vector<Item> items;
  int64_t work = 0;  // query rows x keys over all items
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len <= lens[b], "request ", b, " has more new tokens than context");
    TORCH_CHECK((lens[b] + block_size - 1) / block_size <= width, "block_table too narrow");
    if (q_len > max_query_len) continue;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t j = 0; j < q_len; j += kTile)
        items.push_back({b, h, j, std::min(j + kTile, q_len)});
    work += kv_heads * q_len * group * lens[b];
  }
  [[maybe_unused]] const bool avx512 = use_avx512();
  const char* cache_bytes = static_cast<const char*>(kv_cache.data_ptr());
  const int64_t row_bytes = row * kv_cache.element_size();
  LOOM_DISPATCH(query.scalar_type(), "paged_attention", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* qp = query.data_ptr<scalar_t>();
    const scalar_t* cache = converted ? nullptr : kv_cache.data_ptr<scalar_t>();
    const int64_t num_items = static_cast<int64_t>(items.size());
    auto q_len_of = [&](const Item& it) -> int64_t { return starts[it.req + 1] - starts[it.req]; };
    // Each thread takes a contiguous run of items of about equal work (query rows x
    // keys, plus a fixed cost per item): a prefill tile costs ~16x a decode item, and
    // equal counts left one thread waiting at the barrier in mixed steps. A batch-1
    // decode is a few microseconds of work: waking the pool costs more.
    // (The generic path costs several times the AVX-512 one per key: it splits sooner.)
    const int64_t serial = avx512 ? kSerialWork : kSerialWork / 4;
    const int64_t threads =
        work < serial ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
    std::vector<int64_t> bounds(threads + 1, num_items);
    bounds[0] = 0;
    if (threads > 1) {
      std::vector<int64_t> cost(num_items);
      int64_t total = 0;
      for (int64_t i = 0; i < num_items; ++i) {
        const Item& it = items[i];
        cost[i] = (it.j1 - it.j0) * group * (lens[it.req] - q_len_of(it) + it.j1) + 64 * group;
        total += cost[i];
      }
      int64_t t = 1, sum = 0;
      for (int64_t i = 0; i < num_items && t < threads; ++i) {
        sum += cost[i];
        while (t < threads && sum * threads >= total * t) bounds[t++] = i + 1;
      }
    }
    at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
      for (int64_t thread = first_thread; thread < last_thread; ++thread) {
        const int64_t begin = bounds[thread], end = bounds[thread + 1];
        std::vector<float> buf;
        std::vector<const c10::BFloat16*> ptrs;
        (void)ptrs;
        // (2, num_keys, D): a converted item's K, then V, kept by the thread between
        // calls (fresh pages each step cost more than the conversion)
        static thread_local std::vector<float> item_kv_floats;
        static thread_local std::vector<int32_t> identity;  // block b of it is block b
        BlockPrefetcher prefetcher;
        for (int64_t i = begin; i < end; ++i) {
          const Item& it = items[i];
          if (i + 1 < end) {
            const Item& next = items[i + 1];
            const int64_t next_q_len = starts[next.req + 1] - starts[next.req];
            prefetcher.reset(cache_bytes, table + next.req * width,
                             lens[next.req] - next_q_len + next.j1, next.kv_head, kv_heads,
                             num_slots, block_size, row_bytes,
                             (lens[it.req] - q_len_of(it) + it.j1 + 15) / 16 * 2);
          } else {
            prefetcher.clear();
          }
          const int64_t q_len = q_len_of(it);
          const int32_t* blocks = table + it.req * width;
          const scalar_t* keys = nullptr;
          const scalar_t* values = nullptr;
          if (converted) {
            // The keys the item reads, [first key of its first window, last query's
            // position], in the query's dtype, as rows 0 .. num_keys - 1.
            const int64_t past = lens[it.req] - q_len, num_keys = past + it.j1;
            const int64_t first_key =
                sliding_window > 0 ? std::max<int64_t>(0, past + it.j0 + 1 - sliding_window) : 0;
            item_kv_floats.resize(2 * num_keys * head_dim);  // (room for bf16 too)
            scalar_t* item_kv = reinterpret_cast<scalar_t*>(item_kv_floats.data());
            identity.resize((num_keys + block_size - 1) / block_size);
            for (size_t b = 0; b < identity.size(); ++b) identity[b] = static_cast<int32_t>(b);
            const char* k_rows = cache_bytes + it.kv_head * num_slots * row_bytes;
            const char* v_rows = cache_bytes + (kv_heads + it.kv_head) * num_slots * row_bytes;
            convert_rows(k_rows, row_bytes, blocks, block_size, first_key, num_keys, format,
                         item_kv, head_dim);
            convert_rows(v_rows, row_bytes, blocks, block_size, first_key, num_keys, format,
                         item_kv + num_keys * head_dim, head_dim);
            keys = item_kv;
            values = keys + num_keys * head_dim;
            blocks = identity.data();
          } else {
            keys = cache + it.kv_head * num_slots * head_dim;
            values = cache + (kv_heads + it.kv_head) * num_slots * head_dim;
          }
#if LOOM_HAVE_AVX512_BF16
          if (avx512 && std::is_same_v<scalar_t, c10::BFloat16> &&
              (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
            using bf16 = c10::BFloat16;
            auto* o = reinterpret_cast<bf16*>(op);
            auto* q = reinterpret_cast<const bf16*>(qp);
            auto* k = reinterpret_cast<const bf16*>(keys);
            auto* v = reinterpret_cast<const bf16*>(values);
            const float sc = static_cast<float>(scale);
            const int64_t s0 = query.stride(0), s1 = query.stride(1);
            if (head_dim == 32)
              attention_item_bf16<2>(o, q, k, v, blocks, s0, s1, kv_heads, block_size, group,
                                     it.kv_head, starts[it.req], q_len, lens[it.req], it.j0, it.j1, sc, sliding_window, buf, ptrs, prefetcher);
            else if (head_dim == 64)
              attention_item_bf16<4>(o, q, k, v, blocks, s0, s1, kv_heads, block_size, group,
                                     it.kv_head, starts[it.req], q_len, lens[it.req], it.j0, it.j1, sc, sliding_window, buf, ptrs, prefetcher);
            else
              attention_item_bf16<8>(o, q, k, v, blocks, s0, s1, kv_heads, block_size, group,
                                     it.kv_head, starts[it.req], q_len, lens[it.req], it.j0, it.j1, sc, sliding_window, buf, ptrs, prefetcher);
            continue;
          }
#endif
          attention_item(op, qp, keys, values, blocks, query.stride(0), query.stride(1),
                         kv_heads, block_size, head_dim, group, it.kv_head,
                         starts[it.req], q_len, lens[it.req], it.j0, it.j1,
                         static_cast<float>(scale), sliding_window, buf, prefetcher);
        }
      }
    });
  });
}

}  // namespace loom
