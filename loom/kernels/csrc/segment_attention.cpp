// Bidirectional attention within segments of rows, bf16: a vision tower's windows and
// whole images (loom/model/vision), where every row of a segment sees every other row of
// it and none outside. PyTorch's CPU SDPA ran a Qwen2.5-VL tower's 64-row windows at
// 75 GFLOP/s and its 1,024-row images at 154 (head_dim 80, 2-core Zen 5) against 400+
// for the tower's matmuls: 12% of the tower's time.
//
// One work item is a (segment, head): its keys are packed once for vdpbf16ps, then every
// group of 4 query rows is scored against all of them, the scores softmaxed in float32
// (fast_exp16), the probabilities rounded to bf16 and multiplied into the values,
// also with vdpbf16ps; each row's sums are divided by its float32 sum of exps and rounded
// to bf16 once. The keys packed transposed: per 16 keys and feature pair m, a vector of
// the 16 keys' pair m (a query's pair broadcast against them). The values packed in key
// pairs: per pair of keys and feature d, the two keys' values side by side (a pair of
// probabilities broadcast against 16 features). A row's values depend on its own
// segment alone, never on how the rows are cut into items or groups.

#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace loom {
namespace {

#if LOOM_HAVE_AVX512_BF16
constexpr int kRows = 4;       // query rows scored and summed together
constexpr int kKeyBlocks = 4;  // blocks of 16 keys scored together (16 sum chains)
constexpr int kMaxDimVectors = 8;  // head_dim <= 128

struct Scratch {
  std::vector<int32_t> keys;    // (key blocks, pairs, 16) bf16 pairs
  std::vector<int32_t> values;  // (key pairs, head_dim) bf16 pairs of keys
  std::vector<float> scores;    // (kRows, padded keys)
  std::vector<uint16_t> probs;  // (kRows, padded keys) bf16
};

inline int32_t pair_at(const c10::BFloat16* row, int64_t m) {
  int32_t pair;
  std::memcpy(&pair, row + 2 * m, sizeof(pair));
  return pair;
}

template <int DV>  // head_dim / 16
void segment_item(c10::BFloat16* out, int64_t out_row, const c10::BFloat16* q, int64_t q_row,
                  const c10::BFloat16* k, int64_t k_row, const c10::BFloat16* v,
                  int64_t v_row, int64_t length, float scale, Scratch& s) {
  constexpr int64_t head_dim = DV * 16, pairs = head_dim / 2;
  const int64_t blocks = (length + 16 * kKeyBlocks - 1) / (16 * kKeyBlocks) * kKeyBlocks;
  const int64_t padded = blocks * 16;  // keys, a whole number of kKeyBlocks blocks
  const int64_t key_pairs = (length + 1) / 2;
  s.keys.assign(blocks * pairs * 16, 0);
  s.values.assign(key_pairs * head_dim, 0);
  s.scores.resize(kRows * padded);
  s.probs.assign(kRows * padded, 0);
  for (int64_t j = 0; j < length; ++j) {
    int32_t* block = s.keys.data() + (j / 16) * pairs * 16 + j % 16;
    const c10::BFloat16* key = k + j * k_row;
    for (int64_t m = 0; m < pairs; ++m) block[16 * m] = pair_at(key, m);
  }
  for (int64_t j = 0; j < length; ++j) {
    uint16_t* packed = reinterpret_cast<uint16_t*>(s.values.data() + (j / 2) * head_dim) + j % 2;
    const uint16_t* value = reinterpret_cast<const uint16_t*>(v + j * v_row);
    for (int64_t d = 0; d < head_dim; ++d) packed[2 * d] = value[d];
  }
  for (int64_t r0 = 0; r0 < length; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, length - r0));
    const c10::BFloat16* query[kRows];
    for (int r = 0; r < kRows; ++r) query[r] = q + (r0 + std::min(r, rows - 1)) * q_row;
    // scores: kRows x kKeyBlocks chains, the pairs in order
    for (int64_t b0 = 0; b0 < blocks; b0 += kKeyBlocks) {
      __m512 sum[kRows][kKeyBlocks];
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kKeyBlocks; ++b) sum[r][b] = _mm512_setzero_ps();
      const int32_t* keys = s.keys.data() + b0 * pairs * 16;
      for (int64_t m = 0; m < pairs; ++m) {
        __m512bh key[kKeyBlocks];
        for (int b = 0; b < kKeyBlocks; ++b)
          key[b] = (__m512bh)_mm512_loadu_si512(keys + (b * pairs + m) * 16);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(pair_at(query[r], m));
          for (int b = 0; b < kKeyBlocks; ++b) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], w, key[b]);
        }
      }
      const __m512 by = _mm512_set1_ps(scale);
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kKeyBlocks; ++b)
          _mm512_storeu_ps(s.scores.data() + r * padded + (b0 + b) * 16,
                           _mm512_mul_ps(sum[r][b], by));
    }
    // softmax over the segment's keys: exps rounded to bf16, their float32 sum kept
    float inverse[kRows];
    for (int r = 0; r < kRows; ++r) {
      float* row = s.scores.data() + r * padded;
      uint16_t* prob = s.probs.data() + r * padded;
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + 16 <= length; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
      float max = _mm512_reduce_max_ps(top);
      for (; j < length; ++j) max = std::max(max, row[j]);
      const __m512 peak = _mm512_set1_ps(max);
      __m512 total = _mm512_setzero_ps();
      for (j = 0; j < padded; j += 16) {
        const __mmask16 valid = j + 16 <= length ? 0xffff
            : j >= length ? 0 : static_cast<__mmask16>((1u << (length - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            valid, fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), peak)));
        total = _mm512_add_ps(total, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob + j), float_to_bf16x16(e));
      }
      inverse[r] = 1.f / _mm512_reduce_add_ps(total);
    }
    // values: kRows x DV chains over the key pairs in order
    __m512 acc[kRows][DV];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < key_pairs; ++i) {
      __m512bh value[DV];
      for (int c = 0; c < DV; ++c)
        value[c] = (__m512bh)_mm512_loadu_si512(s.values.data() + i * head_dim + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, s.probs.data() + r * padded + 2 * i, sizeof(pair));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, value[c]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 by = _mm512_set1_ps(inverse[r]);
      c10::BFloat16* o = out + (r0 + r) * out_row;
      for (int c = 0; c < DV; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                            float_to_bf16x16(_mm512_mul_ps(acc[r][c], by)));
    }
  }
}

using ItemFn = void (*)(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                        const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t,
                        float, Scratch&);

ItemFn item_for(int64_t head_dim) {
  switch (head_dim / 16) {
    case 1: return segment_item<1>;
    case 2: return segment_item<2>;
    case 3: return segment_item<3>;
    case 4: return segment_item<4>;
    case 5: return segment_item<5>;
    case 6: return segment_item<6>;
    case 7: return segment_item<7>;
    default: return segment_item<kMaxDimVectors>;
  }
}
#endif

}  // namespace

bool segment_attention_available() { return LOOM_HAVE_AVX512_BF16; }

void segment_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v,
                       at::Tensor lengths, double scale) {
  TORCH_CHECK(segment_attention_available(), "segment_attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes() &&
                  out.sizes() == q.sizes(),
              "q, k, v and out must be (rows, heads, head_dim) alike");
  for (const at::Tensor* t : {&out, &q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1,
                "q, k, v and out must be bfloat16 with contiguous features");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 128,
              "head_dim must be a multiple of 16 up to 128, got ", head_dim);
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.is_cpu(),
              "lengths must be a 1-d int64 CPU tensor");
#if LOOM_HAVE_AVX512_BF16
  const int64_t segments = lengths.size(0);
  const int64_t* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> start(segments + 1, 0);
  for (int64_t i = 0; i < segments; ++i) {
    TORCH_CHECK(length[i] > 0, "segment lengths must be positive");
    start[i + 1] = start[i] + length[i];
  }
  TORCH_CHECK(start[segments] == rows, "segment lengths sum to ", start[segments], ", not ",
              rows, " rows");
  const ItemFn item = item_for(head_dim);
  auto* o = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const auto* qp = reinterpret_cast<const c10::BFloat16*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const c10::BFloat16*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const c10::BFloat16*>(v.data_ptr());
  const float by = static_cast<float>(scale);
  at::parallel_for(0, segments * heads, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t seg = w / heads, h = w % heads, r = start[seg];
      item(o + r * out.stride(0) + h * out.stride(1), out.stride(0),
           qp + r * q.stride(0) + h * q.stride(1), q.stride(0),
           kp + r * k.stride(0) + h * k.stride(1), k.stride(0),
           vp + r * v.stride(0) + h * v.stride(1), v.stride(0), length[seg], by, scratch);
    }
  });
#endif
}

}  // namespace loom
