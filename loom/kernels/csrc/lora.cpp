// LoRA adapters on a linear layer's output, batched (loom/model/layers/lora.py), in one
// native pass over the step's rows (Punica's BGMV): each row t of x whose request runs
// adapter slot s = token_slot[t] (>= 0 and active[s]; -1: the base) gets
// (x_t A_s^T) B_s added to its row of y: A_s (R, K) as PEFT's lora_A, B_s (R, N) its
// lora_B transposed, the scale folded in.
//
// - shrink: h[t, r] = dot(x_t, A_s[r]) in float32, one task per (slot, r) doing that
//   slot's rows one after another (A_s's row comes from memory once for all of them).
//   bf16 weights: x rounded to bf16 first (as torch's x.to(a.dtype)), then pairs of
//   products summed by vdpbf16ps in four chains of 32 values (AVX512-BF16), or 64 float
//   lanes in the generic path; float32 weights: the generic path's 64 lanes.
// - expand: y[t, n] += sum_r h[t, r] B_s[r, n], h kept in float32, parallel over blocks
//   of 128 columns: per column a chain of multiply-adds over r in order, started from 0
//   (fused on the AVX-512 path, 16 columns a vector, each vector of B loaded once for up
//   to 4 rows of its slot), then added to y and rounded once to y's dtype.
// - a fused layer's parts (q|k|v, gate|up; `part_sizes`, top to bottom, P of them):
//   part p's columns read only rank rows [p R/P, (p+1) R/P) of B, the others being zero
//   (LoRASlots.load), so a q|k|v layer's expand reads a third of B. An empty list: one
//   part, every rank row.
//
// Batch invariance: every h[t, r] and every y[t, n] is one row's sum in an order fixed
// by K, R and the part layout alone (the lanes and chains by index, not by address or by
// how many rows or threads there are), computed whole by one thread: a row gets the same
// bits alone or in any batch. A step without adapters returns after one pass over
// token_slot, so the base model's rows cost nothing more.
//
// The token embeddings' adapter (PEFT's lora_embedding_A/B) is the same expand with a
// gather for the shrink: row t gets B_s^T A_s^T[ids[t]], A held transposed (V, R) per
// slot.

#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

namespace loom {
namespace {

constexpr int64_t kExpandColumns = 128;  // columns per expand task
constexpr int64_t kLanes = 64;           // the generic path's partial sums

// The rows that run an adapter on this layer, slot by slot (ascending), each slot's rows
// in order: rows[begin[g], begin[g + 1]) run slot[g].
struct Groups {
  std::vector<int64_t> rows, slot, begin;
  int64_t count() const { return static_cast<int64_t>(slot.size()); }
};

Groups group_rows(const char* name, const at::Tensor& token_slot, const at::Tensor& active,
                  int64_t rows, int64_t slots) {
  check_cpu(token_slot, "token_slot");
  check_cpu(active, "active");
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.numel() == rows &&
                  token_slot.is_contiguous(),
              name, ": token_slot must be (T,) int64, one slot per row");
  TORCH_CHECK(active.scalar_type() == at::kBool && active.numel() == slots &&
                  active.is_contiguous(),
              name, ": active must be (S,) bool");
  const int64_t* slot_of = token_slot.data_ptr<int64_t>();
  const bool* is_active = active.data_ptr<bool>();
  std::vector<int64_t> count(slots, 0);
  int64_t total = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slot_of[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, name, ": row ", t, " names slot ", slot, " of ", slots);
    if (is_active[slot]) ++count[slot], ++total;
  }
  Groups groups;
  if (total == 0) return groups;
  std::vector<int64_t> next(slots, 0);
  groups.begin.push_back(0);
  for (int64_t s = 0, at = 0; s < slots; ++s) {
    if (count[s] == 0) continue;
    next[s] = at;
    at += count[s];
    groups.slot.push_back(s);
    groups.begin.push_back(at);
  }
  groups.rows.resize(total);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slot_of[t];
    if (slot >= 0 && is_active[slot]) groups.rows[next[slot]++] = t;
  }
  return groups;
}

// ---------------------------------------------------------------- shrink

// sum a[i] x[i]: 64 lanes (lane l takes i = l mod 64), then halved in order to one
template <typename W>
float dot_generic(const W* a, const W* x, int64_t k) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += to_float(a[i + l]) * to_float(x[i + l]);
  for (int64_t l = 0; i + l < k; ++l) lane[l] += to_float(a[i + l]) * to_float(x[i + l]);
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

#if LOOM_HAVE_AVX512_BF16
// sum a[i] x[i] by vdpbf16ps: chunk c of 32 values into chain c mod 4 (the last one
// masked), the chains added (0 + 1) + (2 + 3), then the 16 lanes
float dot_bf16_avx512(const c10::BFloat16* a, const c10::BFloat16* x, int64_t k) {
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 128 <= k; i += 128)
    for (int c = 0; c < 4; ++c)
      sum[c] = _mm512_dpbf16_ps(sum[c], (__m512bh)_mm512_loadu_si512(a + i + 32 * c),
                                (__m512bh)_mm512_loadu_si512(x + i + 32 * c));
  for (int c = 0; i < k; i += 32, ++c) {
    const int64_t left = k - i;
    const __mmask32 mask = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    sum[c] = _mm512_dpbf16_ps(sum[c], (__m512bh)_mm512_maskz_loadu_epi16(mask, a + i),
                              (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
}
#endif

template <typename W>
float shrink_dot(const W* a, const W* x, int64_t k, bool avx512) {
#if LOOM_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<W, c10::BFloat16>)
    if (avx512) return dot_bf16_avx512(a, x, k);
#endif
  (void)avx512;
  return dot_generic(a, x, k);
}

// ---------------------------------------------------------------- expand

#if LOOM_HAVE_AVX512_BF16
template <typename W>
inline __m512 load16(const W* p, __mmask16 mask) {
  if constexpr (std::is_same_v<W, float>)
    return _mm512_maskz_loadu_ps(mask, p);
  else
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

template <typename Y>
inline void store16(Y* p, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<Y, float>)
    _mm512_mask_storeu_ps(p, mask, v);
  else
    _mm256_mask_storeu_epi16(p, mask, float_to_bf16x16(v));
}

// rows m < M: y[m][j] += sum_r h[m][r] b[r ldb + j] for j < V * 16 (the last vector's
// lanes masked by `last`), each B vector loaded once for the M rows (of one slot)
template <typename W, typename Y, int V, int M>
inline void expand_vectors(Y* const* y, const W* b, int64_t ldb, const float* const* h,
                           int64_t ranks, __mmask16 last) {
  __m512 sum[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) sum[m][v] = _mm512_setzero_ps();
  for (int64_t r = 0; r < ranks; ++r) {
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load16(b + r * ldb + 16 * v, v == V - 1 ? last : 0xffff);
    for (int m = 0; m < M; ++m) {
      const __m512 hr = _mm512_set1_ps(h[m][r]);
      for (int v = 0; v < V; ++v) sum[m][v] = _mm512_fmadd_ps(hr, bv[v], sum[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      const __mmask16 mask = v == V - 1 ? last : 0xffff;
      store16(y[m] + 16 * v, _mm512_add_ps(load16(y[m] + 16 * v, mask), sum[m][v]), mask);
    }
}

template <typename W, typename Y, int M>
void expand_rows_avx512(Y* const* y, const W* b, int64_t ldb, const float* const* h,
                        int64_t ranks, int64_t columns) {
  int64_t j = 0;
  Y* yj[M];
  for (; j + 64 <= columns; j += 64) {
    for (int m = 0; m < M; ++m) yj[m] = y[m] + j;
    expand_vectors<W, Y, 4, M>(yj, b + j, ldb, h, ranks, 0xffff);
  }
  for (; j < columns; j += 16) {
    const int64_t left = columns - j;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    for (int m = 0; m < M; ++m) yj[m] = y[m] + j;
    expand_vectors<W, Y, 1, M>(yj, b + j, ldb, h, ranks, mask);
  }
}
#endif

// rows m < count: y[m][j] += sum_r h[m][r] b[r ldb + j] for j < columns; every column's
// sum alike, whichever rows share the call: from 0, r in order, then added to y
template <typename W, typename Y>
void expand_rows(Y* const* y, const W* b, int64_t ldb, const float* const* h, int64_t count,
                 int64_t ranks, int64_t columns, bool avx512) {
#if LOOM_HAVE_AVX512_BF16
  if (avx512) {
    for (int64_t m = 0; m < count; m += 4) {  // up to 4 rows on each load of B
      switch (std::min<int64_t>(4, count - m)) {
        case 4: expand_rows_avx512<W, Y, 4>(y + m, b, ldb, h + m, ranks, columns); break;
        case 3: expand_rows_avx512<W, Y, 3>(y + m, b, ldb, h + m, ranks, columns); break;
        case 2: expand_rows_avx512<W, Y, 2>(y + m, b, ldb, h + m, ranks, columns); break;
        default: expand_rows_avx512<W, Y, 1>(y + m, b, ldb, h + m, ranks, columns);
      }
    }
    return;
  }
#endif
  (void)avx512;
  for (int64_t m = 0; m < count; ++m)
    for (int64_t j = 0; j < columns; j += kLanes) {
      const int64_t width = std::min(kLanes, columns - j);
      float sum[kLanes] = {};
      for (int64_t r = 0; r < ranks; ++r) {
        const float hr = h[m][r];
        const W* br = b + r * ldb + j;
        for (int64_t l = 0; l < width; ++l) sum[l] += hr * to_float(br[l]);
      }
      for (int64_t l = 0; l < width; ++l)
        y[m][j + l] = from_float<Y>(to_float(y[m][j + l]) + sum[l]);
    }
}

// A part of the output: columns [first, first + size) and the rank rows they read.
struct Part {
  int64_t first, size, rank_first, ranks;
};

std::vector<Part> parts_of(const char* name, const std::vector<int64_t>& part_sizes,
                           int64_t n, int64_t r) {
  if (part_sizes.empty()) return {Part{0, n, 0, r}};
  const auto count = static_cast<int64_t>(part_sizes.size());
  TORCH_CHECK(r % count == 0, name, ": ", count, " parts must share the rank ", r, " evenly");
  std::vector<Part> parts;
  int64_t first = 0;
  for (int64_t p = 0; p < count; ++p) {
    TORCH_CHECK(part_sizes[p] >= 0, name, ": part sizes must not be negative");
    parts.push_back(Part{first, part_sizes[p], p * (r / count), r / count});
    first += part_sizes[p];
  }
  TORCH_CHECK(first == n, name, ": part sizes sum to ", first, ", not y's ", n, " columns");
  return parts;
}

// y's rows of `groups` += h (one row of R per grouped row) times B (S, R, N) of their
// slot, in tasks of up to kExpandColumns columns of one part for one slot's rows, slot
// by slot (a thread streams through one slot's B at a time)
template <typename W, typename Y>
void expand(Y* y, int64_t ldy, const W* b, const at::IntArrayRef b_strides, int64_t r,
            const Groups& groups, const float* h, const std::vector<Part>& parts,
            bool avx512) {
  const int64_t per_slot = b_strides[0], ldb = b_strides[1];
  struct Task {
    int64_t group, part, first, columns;
  };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < groups.count(); ++g)
    for (int64_t p = 0; p < static_cast<int64_t>(parts.size()); ++p)
      for (int64_t j = 0; j < parts[p].size; j += kExpandColumns)
        tasks.push_back(Task{g, p, parts[p].first + j,
                             std::min(kExpandColumns, parts[p].size - j)});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<Y*> ys(groups.rows.size());  // the task's rows of y and of h
    std::vector<const float*> hs(groups.rows.size());
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const Part& part = parts[task.part];
      const int64_t first = groups.begin[task.group];
      const int64_t count = groups.begin[task.group + 1] - first;
      for (int64_t e = 0; e < count; ++e) {
        ys[e] = y + groups.rows[first + e] * ldy + task.first;
        hs[e] = h + (first + e) * r + part.rank_first;
      }
      const W* bs = b + groups.slot[task.group] * per_slot + part.rank_first * ldb + task.first;
      expand_rows(ys.data(), bs, ldb, hs.data(), count, part.ranks, task.columns, avx512);
    }
  });
}

void check_weights(const char* name, const at::Tensor& a, const at::Tensor& b) {
  check_cpu(a, "a");
  check_cpu(b, "b");
  check_float_or_bf16(a, "a");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": a and b must have one dtype");
  TORCH_CHECK(a.stride(2) == 1 && b.stride(2) == 1, name, ": a's and b's rows must be "
              "contiguous");
}

void check_rows(const char* name, const at::Tensor& t, const char* what) {
  check_cpu(t, what);
  check_float_or_bf16(t, what);
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, name, ": ", what,
              "'s rows must be contiguous");
}

}  // namespace

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& token_slot, const at::Tensor& active,
              const std::vector<int64_t>& part_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add: x (T, K) and y (T, N) must have the same rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                  a.size(2) == x.size(1) && b.size(2) == y.size(1) && a.size(1) == b.size(1),
              "lora_add: a (S, R, K) and b (S, R, N) must fit x (T, K) and y (T, N)");
  check_weights("lora_add", a, b);
  check_rows("lora_add", x, "x");
  check_rows("lora_add", y, "y");
  const Groups groups = group_rows("lora_add", token_slot, active, x.size(0), a.size(0));
  if (groups.count() == 0) return;
  const int64_t k = x.size(1), r = a.size(1), n = y.size(1);
  const auto parts = parts_of("lora_add", part_sizes, n, r);
  const auto entries = static_cast<int64_t>(groups.rows.size());
  std::vector<float> h(entries * r);
  const bool avx512 = use_avx512();
  LOOM_DISPATCH(a.scalar_type(), "lora_add", [&] {
    using W = scalar_t;
    // x's rows as W (torch's x.to(a.dtype)): x itself, or a copy of the grouped rows
    std::vector<W> copied;
    const W* xw = nullptr;
    int64_t ldx = k;
    if (x.scalar_type() == a.scalar_type()) {
      xw = x.data_ptr<W>();
      ldx = x.stride(0);
    } else {
      copied.resize(entries * k);
      LOOM_DISPATCH(x.scalar_type(), "lora_add", [&] {
        const scalar_t* xs = x.data_ptr<scalar_t>();
        for (int64_t e = 0; e < entries; ++e)
          for (int64_t i = 0; i < k; ++i)
            copied[e * k + i] = from_float<W>(to_float(xs[groups.rows[e] * x.stride(0) + i]));
      });
      xw = copied.data();
    }
    const bool direct = copied.empty();
    const W* aw = a.data_ptr<W>();
    at::parallel_for(0, groups.count() * r, 4, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / r, rank = task % r;
        const W* row_of_a = aw + groups.slot[g] * a.stride(0) + rank * a.stride(1);
        for (int64_t e = groups.begin[g]; e < groups.begin[g + 1]; ++e) {
          const W* xe = direct ? xw + groups.rows[e] * ldx : xw + e * k;
          h[e * r + rank] = shrink_dot(row_of_a, xe, k, avx512);
        }
      }
    });
    LOOM_DISPATCH(y.scalar_type(), "lora_add", [&] {
      expand(y.data_ptr<scalar_t>(), y.stride(0), b.data_ptr<W>(), b.strides(), r, groups,
             h.data(), parts, avx512);
    });
  });
}

void lora_embedding_add(at::Tensor y, const at::Tensor& ids, const at::Tensor& a_t,
                        const at::Tensor& b, const at::Tensor& token_slot,
                        const at::Tensor& active) {
  TORCH_CHECK(y.dim() == 2 && ids.dim() == 1 && ids.size(0) == y.size(0) &&
                  ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "lora_embedding_add: ids (T,) int64 and y (T, D) must have the same rows");
  TORCH_CHECK(a_t.dim() == 3 && b.dim() == 3 && a_t.size(0) == b.size(0) &&
                  b.size(2) == y.size(1) && a_t.size(2) == b.size(1),
              "lora_embedding_add: a_t (S, V, R) and b (S, R, D) must fit y (T, D)");
  check_weights("lora_embedding_add", a_t, b);
  check_rows("lora_embedding_add", y, "y");
  check_cpu(ids, "ids");
  const Groups groups = group_rows("lora_embedding_add", token_slot, active, y.size(0),
                                   a_t.size(0));
  if (groups.count() == 0) return;
  const int64_t vocab = a_t.size(1), r = a_t.size(2), n = y.size(1);
  const auto entries = static_cast<int64_t>(groups.rows.size());
  std::vector<float> h(entries * r);
  const int64_t* id = ids.data_ptr<int64_t>();
  const bool avx512 = use_avx512();
  LOOM_DISPATCH(a_t.scalar_type(), "lora_embedding_add", [&] {
    using W = scalar_t;
    const W* aw = a_t.data_ptr<W>();
    for (int64_t g = 0; g < groups.count(); ++g)
      for (int64_t e = groups.begin[g]; e < groups.begin[g + 1]; ++e) {
        const int64_t token = id[groups.rows[e]];
        TORCH_CHECK(token >= 0 && token < vocab, "lora_embedding_add: row ", groups.rows[e],
                    "'s id ", token, " is outside the vocabulary of ", vocab);
        const W* column = aw + groups.slot[g] * a_t.stride(0) + token * a_t.stride(1);
        for (int64_t i = 0; i < r; ++i) h[e * r + i] = to_float(column[i]);
      }
    LOOM_DISPATCH(y.scalar_type(), "lora_embedding_add", [&] {
      expand(y.data_ptr<scalar_t>(), y.stride(0), b.data_ptr<W>(), b.strides(), r, groups,
             h.data(), {Part{0, n, 0, r}}, avx512);
    });
  });
}

}  // namespace loom
