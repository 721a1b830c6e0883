// MoBA, mixture of block attention, over the paged cache (loom/model/attention/moba.py
// states the algorithm and is the PyTorch reference these kernels equal).
//
// moba_update_block_means: for each request, every MoBA block of B = moba_block_size
// positions whose last position this step wrote gets its mean key, per KV head, in
// `means` (Hkv, num_blocks, D) float32 at the cache block holding that last position.
//
// moba_attention: each query at position p sees, when p + 1 >= min_seq_len, its own
// block's keys up to p and the topk - 1 earlier blocks whose mean key scores highest
// against it (q . mean, float32; equal gates: the earlier block), per query head;
// below min_seq_len, keys 0 .. p. One softmax (float32) over them, the output rounded
// once. The cache is read in its dtype (the model's, bf16 under a float32 model, or int8
// or fp8 rows dequantized to the model's dtype as paged_attention reads them).
//
// Work items: (request, KV head, tile of up to kTile query tokens), the tile's G * tile
// rows (query heads of the KV head) sharing each block of K/V they load: the union of
// the rows' blocks is walked once, a block's keys (then values) converted to float32
// once, each row scoring only the keys it sees. Items go to threads in runs of about
// equal work (rows x keys seen). Every decision is taken here from the step's tensors,
// so a replayed forward (replay.h) takes them anew at each step.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <limits>
#include <vector>

namespace loom {
namespace {

constexpr int64_t kTile = 8;  // query tokens a work item takes (see above)
constexpr int64_t kSerialWork = 1 << 14;  // rows x keys below which one thread runs it all

enum class CacheKind { kFloat, kBFloat16, kQuantized };

// One cache row (K or V of one token and head) as float32, read as a model in T reads
// it: a quantized row (int8 or fp8, `format`) dequantized to T, then widened.
template <typename T>
inline void read_row(const char* row, CacheKind kind, KvFormat format, float* dst,
                     int64_t head_dim, T* tmp) {
  switch (kind) {
    case CacheKind::kFloat:
      std::memcpy(dst, row, head_dim * sizeof(float));
      break;
    case CacheKind::kBFloat16:
      load_row(reinterpret_cast<const c10::BFloat16*>(row), dst, head_dim);
      break;
    case CacheKind::kQuantized:
      dequantize_kv_row(row, tmp, head_dim, format);
      load_row(tmp, dst, head_dim);
      break;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Lane i of the result is the sum of a[i]'s 8 lanes.
inline __m256 sum_lanes8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// s[i] = scale * q . keys[i] for n keys, rows of D floats: 8 keys at a time, one sum per
// key in registers (16 lanes with AVX-512), then reduced together.
inline void score_keys(const float* q, const float* keys, int64_t n, int64_t D, float scale,
                       float* s) {
  int64_t i = 0;
#if LOOM_HAVE_AVX512_BF16
  if (D % 16 == 0 && use_avx512()) {
    for (; i + 8 <= n; i += 8) {
      __m512 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        const __m512 qv = _mm512_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j)
          a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + (i + j) * D + c), a[j]);
      }
      __m256 h[8];
      for (int j = 0; j < 8; ++j)
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
      _mm256_storeu_ps(s + i, _mm256_mul_ps(sum_lanes8(h), _mm256_set1_ps(scale)));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; i + 8 <= n; i += 8) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j)
          a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (i + j) * D + c), a[j]);
      }
      _mm256_storeu_ps(s + i, _mm256_mul_ps(sum_lanes8(a), _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; i < n; ++i) s[i] = dot(q, keys + i * D, D) * scale;
}

// acc[r] += sum_i w[r][i] * v[i] over n rows of D floats, for R rows at once: 16 columns
// at a time, the R x 16 sums in registers over the n values.
template <int R>
inline void add_weighted(float* const* acc, const float* const* w, const float* v, int64_t n,
                         int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0) {
    for (int64_t c = 0; c < D; c += 16) {
      __m256 a[R][2];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) a[r][h] = _mm256_loadu_ps(acc[r] + c + 8 * h);
      for (int64_t i = 0; i < n; ++i) {
        const __m256 v0 = _mm256_loadu_ps(v + i * D + c), v1 = _mm256_loadu_ps(v + i * D + c + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 wr = _mm256_broadcast_ss(w[r] + i);
          a[r][0] = _mm256_fmadd_ps(wr, v0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(wr, v1, a[r][1]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc[r] + c + 8 * h, a[r][h]);
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const float wi = w[r][i];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[r][d] += wi * v[i * D + d];
    }
}

struct Layout {
  const char* cache;
  CacheKind kind;
  int64_t kv_heads, num_slots, block_size, row_bytes, head_dim;
  KvFormat format;  // a quantized cache's row format
  // row `position` of kind (0 K, 1 V) and KV head `h` of the request whose blocks these are
  const char* row(int kv, int64_t h, const int32_t* blocks, int64_t position) const {
    const int64_t slot = static_cast<int64_t>(blocks[position / block_size]) * block_size +
                         position % block_size;
    return cache + ((kv * kv_heads + h) * num_slots + slot) * row_bytes;
  }
};

CacheKind cache_kind(const at::Tensor& kv_cache) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return CacheKind::kFloat;
    case at::kBFloat16: return CacheKind::kBFloat16;
    case at::kChar:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2: return CacheKind::kQuantized;
    default: TORCH_CHECK(false, "kv_cache must be float32, bfloat16, int8 or fp8");
  }
  return CacheKind::kFloat;
}

// One row's keys: blocks in ascending order, `count` keys from the block's start each,
// at `offset` in the row's scores.
struct Span { int64_t block, count, offset; };

struct Scratch {
  std::vector<float> q, acc, scores, kv, inv_sum, gates, weights;
  std::vector<std::pair<int64_t, int64_t>> users;  // a block's rows and their spans
  std::vector<Span> spans;            // every row's, row r's at [first[r], first[r + 1])
  std::vector<int64_t> first, cursor, need, chosen;
  std::vector<char> tmp;              // a dequantized row in the model's dtype
};

template <typename T>
void moba_item(T* out, const T* query, int64_t q_stride0, int64_t q_stride1, const Layout& L,
               const float* means, int64_t means_blocks, const int32_t* blocks, int64_t group,
               int64_t kv_head, int64_t first_token, int64_t past, int64_t j0, int64_t j1,
               float scale, int64_t moba_block, int64_t topk, int64_t min_seq_len,
               Scratch& s) {
  const int64_t D = L.head_dim, rows = (j1 - j0) * group;
  const int64_t per = moba_block / L.block_size;  // cache blocks per MoBA block
  s.q.resize(rows * D);
  s.tmp.resize(D * sizeof(T));
  T* tmp = reinterpret_cast<T*>(s.tmp.data());
  for (int64_t r = 0; r < rows; ++r)
    load_row(query + (first_token + j0 + r / group) * q_stride0 +
                 (kv_head * group + r % group) * q_stride1,
             s.q.data() + r * D, D);
  // each row's spans
  s.spans.clear();
  s.first.assign(rows + 1, 0);
  int64_t widest = 0, last_block = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = past + j0 + r / group, own = p / moba_block;
    const float* q = s.q.data() + r * D;
    int64_t offset = 0;
    auto add = [&](int64_t block, int64_t count) {
      s.spans.push_back({block, count, offset});
      offset += count;
    };
    if (p + 1 < min_seq_len) {  // full attention
      for (int64_t m = 0; m < own; ++m) add(m, moba_block);
    } else {
      const int64_t k = std::min(topk - 1, own);
      s.chosen.clear();  // the best k so far, best first; a later block passes only a greater gate
      s.gates.clear();
      for (int64_t m = 0; m < own && k > 0; ++m) {
        const int64_t at = blocks[(m + 1) * per - 1];
        const float gate = dot(q, means + (kv_head * means_blocks + at) * D, D);
        if (static_cast<int64_t>(s.chosen.size()) == k && gate <= s.gates.back()) continue;
        int64_t i = static_cast<int64_t>(s.gates.size());
        if (i == k) {
          s.gates.pop_back();
          s.chosen.pop_back();
          --i;
        }
        while (i > 0 && s.gates[i - 1] < gate) --i;
        s.gates.insert(s.gates.begin() + i, gate);
        s.chosen.insert(s.chosen.begin() + i, m);
      }
      std::sort(s.chosen.begin(), s.chosen.end());
      for (int64_t m : s.chosen) add(m, moba_block);
    }
    add(own, p - own * moba_block + 1);
    s.first[r + 1] = static_cast<int64_t>(s.spans.size());
    widest = std::max(widest, offset);
    last_block = std::max(last_block, own);
  }
  // the union of the rows' blocks: how many keys of each any row sees
  s.need.assign(last_block + 1, 0);
  for (const Span& span : s.spans) s.need[span.block] = std::max(s.need[span.block], span.count);
  s.scores.resize(rows * widest);
  s.kv.resize(moba_block * D);
  s.acc.assign(rows * D, 0.f);
  s.inv_sum.resize(rows);
  // Over the union, each block's keys (or values) loaded into s.kv as float rows, then
  // f(n, the rows that see it: (row, its span) pairs)
  auto walk = [&](int kv, auto&& f) {
    s.cursor.assign(s.first.begin(), s.first.end() - 1);
    for (int64_t m = 0; m <= last_block; ++m) {
      const int64_t n = s.need[m];
      if (n == 0) continue;
      for (int64_t i = 0; i < n; ++i)
        read_row(L.row(kv, kv_head, blocks, m * moba_block + i), L.kind, L.format,
                 s.kv.data() + i * D, D, tmp);
      s.users.clear();
      for (int64_t r = 0; r < rows; ++r) {
        int64_t& c = s.cursor[r];
        if (c < s.first[r + 1] && s.spans[c].block == m) s.users.push_back({r, c++});
      }
      f(n);
    }
  };
  walk(0, [&](int64_t) {
    for (const auto& [r, c] : s.users)
      score_keys(s.q.data() + r * D, s.kv.data(), s.spans[c].count, D, scale,
                 s.scores.data() + r * widest + s.spans[c].offset);
  });
  for (int64_t r = 0; r < rows; ++r) {
    const Span& tail = s.spans[s.first[r + 1] - 1];
    const int64_t n = tail.offset + tail.count;
    float* sc = s.scores.data() + r * widest;
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) max = std::max(max, sc[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sc[i] = fast_exp(sc[i] - max);
      sum += sc[i];
    }
    s.inv_sum[r] = 1.f / sum;
  }
  // each row's weights of a block, zero past its span (its own block: past its position)
  s.weights.resize(4 * moba_block);
  walk(1, [&](int64_t n) {
    const int64_t users = static_cast<int64_t>(s.users.size());
    for (int64_t u = 0; u < users; u += 4) {
      const int64_t k = std::min<int64_t>(4, users - u);
      float* acc[4];
      const float* w[4];
      int64_t longest = 0;
      for (int64_t j = 0; j < k; ++j) {
        const auto& [r, c] = s.users[u + j];
        const Span& span = s.spans[c];
        acc[j] = s.acc.data() + r * D;
        float* wj = s.weights.data() + j * moba_block;
        std::memcpy(wj, s.scores.data() + r * widest + span.offset, span.count * sizeof(float));
        std::fill(wj + span.count, wj + n, 0.f);
        w[j] = wj;
        longest = std::max(longest, span.count);
      }
      if (k == 4) add_weighted<4>(acc, w, s.kv.data(), longest, D);
      if (k == 3) add_weighted<3>(acc, w, s.kv.data(), longest, D);
      if (k == 2) add_weighted<2>(acc, w, s.kv.data(), longest, D);
      if (k == 1) add_weighted<1>(acc, w, s.kv.data(), longest, D);
    }
  });
  const int64_t heads = L.kv_heads * group;
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + ((first_token + j0 + r / group) * heads + kv_head * group + r % group) * D;
    const float* a = s.acc.data() + r * D;
    const float inv = s.inv_sum[r];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = from_float<T>(a[d] * inv);
  }
}

struct Step {
  const int32_t *lens, *starts, *table;
  int64_t num_reqs, width;
};

Step check_step(const at::Tensor& block_table, const at::Tensor& seq_lens,
                const at::Tensor& query_start_loc, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_table, seq_lens, query_start_loc must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous() && block_table.dim() == 2,
              "block_table (2-d), seq_lens, query_start_loc must be contiguous");
  Step step{seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
            block_table.data_ptr<int32_t>(), seq_lens.size(0), block_table.size(1)};
  TORCH_CHECK(query_start_loc.size(0) == step.num_reqs + 1 &&
                  block_table.size(0) == step.num_reqs,
              "query_start_loc must have one more entry than seq_lens and block_table rows");
  for (int64_t b = 0; b < step.num_reqs; ++b) {
    TORCH_CHECK(step.starts[b + 1] - step.starts[b] <= step.lens[b],
                "request ", b, " has more new tokens than context");
    TORCH_CHECK((step.lens[b] + block_size - 1) / block_size <= step.width,
                "block_table too narrow");
  }
  // checked here, not in the parallel loops (an exception must not leave an OpenMP region)
  for (int64_t i = 0; i < step.num_reqs * step.width; ++i)
    TORCH_CHECK(step.table[i] >= 0 && step.table[i] < num_blocks,
                "block_table entry ", step.table[i], " is not a block of the cache");
  return step;
}

Layout layout_of(const at::Tensor& kv_cache) {
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous 5-d");
  const CacheKind kind = cache_kind(kv_cache);
  const int64_t block_size = kv_cache.size(3), row = kv_cache.size(4);
  return Layout{static_cast<const char*>(kv_cache.data_ptr()), kind, kv_cache.size(1),
                kv_cache.size(2) * block_size, block_size, row * kv_cache.element_size(),
                kind == CacheKind::kQuantized ? row - kKvScaleBytes : row,
                kv_format(kv_cache.scalar_type())};
}

void check_means(const at::Tensor& means, const Layout& L, int64_t moba_block_size) {
  TORCH_CHECK(means.scalar_type() == at::kFloat && means.is_contiguous() && means.dim() == 3 &&
                  means.size(0) == L.kv_heads && means.size(1) == L.num_slots / L.block_size &&
                  means.size(2) == L.head_dim,
              "means must be contiguous float32 (num_kv_heads, num_blocks, head_dim)");
  TORCH_CHECK(moba_block_size > 0 && moba_block_size % L.block_size == 0,
              "moba_block_size must be a multiple of the cache's block size");
}

}  // namespace

void moba_update_block_means(at::Tensor means, at::Tensor kv_cache, at::Tensor block_table,
                             at::Tensor seq_lens, at::Tensor query_start_loc,
                             int64_t moba_block_size) {
  const Layout L = layout_of(kv_cache);
  check_means(means, L, moba_block_size);
  const Step step = check_step(block_table, seq_lens, query_start_loc, L.block_size,
                               L.num_slots / L.block_size);
  struct Item { int64_t req, block, kv_head; };
  std::vector<Item> items;
  for (int64_t b = 0; b < step.num_reqs; ++b) {
    const int64_t len = step.lens[b], past = len - (step.starts[b + 1] - step.starts[b]);
    for (int64_t m = past / moba_block_size; m < len / moba_block_size; ++m)
      for (int64_t h = 0; h < L.kv_heads; ++h) items.push_back({b, m, h});
  }
  if (items.empty()) return;
  float* out = means.data_ptr<float>();
  const int64_t num_blocks = means.size(1), D = L.head_dim, per = moba_block_size / L.block_size;
  const int64_t work = static_cast<int64_t>(items.size()) * moba_block_size * D;
  const int64_t grain = work < (1 << 16) ? static_cast<int64_t>(items.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(D), sum(D);
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = items[i];
      const int32_t* blocks = step.table + it.req * step.width;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t p = it.block * moba_block_size; p < (it.block + 1) * moba_block_size; ++p) {
        // float32 keys: an int8 row's q * scale unrounded, as the PyTorch path's
        read_row<float>(L.row(0, it.kv_head, blocks, p), L.kind, L.format, row.data(), D,
                        row.data());
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) sum[d] += row[d];
      }
      const int64_t at = blocks[(it.block + 1) * per - 1];
      float* dst = out + (it.kv_head * num_blocks + at) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = sum[d] / static_cast<float>(moba_block_size);
    }
  });
}

void moba_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor means,
                    at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_start_loc,
                    double scale, int64_t moba_block_size, int64_t topk, int64_t min_seq_len) {
  const Layout L = layout_of(kv_cache);
  check_means(means, L, moba_block_size);
  TORCH_CHECK(topk >= 1 && min_seq_len >= 0, "topk must be positive, min_seq_len not negative");
  check_float_or_bf16(query, "query");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out and query dtypes differ");
  TORCH_CHECK(L.kind == CacheKind::kQuantized || kv_cache.scalar_type() == query.scalar_type() ||
                  (query.scalar_type() == at::kFloat && L.kind == CacheKind::kBFloat16),
              "kv_cache dtype does not go with the query's");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be (T, H, D), last dim contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous, shaped as query");
  const int64_t heads = query.size(1), group = heads / L.kv_heads;
  TORCH_CHECK(heads % L.kv_heads == 0 && query.size(2) == L.head_dim, "head counts/dims do not match");
  const Step step = check_step(block_table, seq_lens, query_start_loc, L.block_size,
                               L.num_slots / L.block_size);

  struct Item { int64_t req, kv_head, j0, j1, cost; };
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t b = 0; b < step.num_reqs; ++b) {
    const int64_t q_len = step.starts[b + 1] - step.starts[b], past = step.lens[b] - q_len;
    for (int64_t j = 0; j < q_len; j += kTile) {
      const int64_t j1 = std::min(j + kTile, q_len), last = past + j1;  // keys seen, at most
      const int64_t seen = last < min_seq_len ? last : std::min(last, topk * moba_block_size);
      const int64_t cost = (j1 - j) * group * seen + 64 * group;
      for (int64_t h = 0; h < L.kv_heads; ++h) items.push_back({b, h, j, j1, cost});
      total += cost * L.kv_heads;
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t threads = total < kSerialWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  std::vector<int64_t> bounds(threads + 1, num_items);
  bounds[0] = 0;
  for (int64_t i = 0, t = 1, sum = 0; i < num_items && t < threads; ++i) {
    sum += items[i].cost;
    while (t < threads && sum * threads >= total * t) bounds[t++] = i + 1;
  }
  const float* mp = means.data_ptr<float>();
  const int64_t means_blocks = means.size(1);
  LOOM_DISPATCH(query.scalar_type(), "moba_attention", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* qp = query.data_ptr<scalar_t>();
    at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
      static thread_local Scratch scratch;  // kept between calls: no fresh pages per step
      for (int64_t thread = first_thread; thread < last_thread; ++thread)
        for (int64_t i = bounds[thread]; i < bounds[thread + 1]; ++i) {
          const Item& it = items[i];
          const int64_t q_len = step.starts[it.req + 1] - step.starts[it.req];
          moba_item(op, qp, query.stride(0), query.stride(1), L, mp, means_blocks,
                    step.table + it.req * step.width, group, it.kv_head, step.starts[it.req],
                    step.lens[it.req] - q_len, it.j0, it.j1, static_cast<float>(scale),
                    moba_block_size, topk, min_seq_len, scratch);
        }
    });
  });
}

}  // namespace loom
