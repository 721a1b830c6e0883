// Writing a step's new K/V into the paged cache.

#include "common.h"
#include "ops.h"

namespace loom {

// kv_cache (2, Hkv, num_blocks, block_size, D) in the model's dtype, in bf16 under a
// float32 model (rounded), or quantized (int8, float8_e4m3fn or float8_e5m2) with rows of
// D + 4 bytes (the values, then their scale: common.h's quantize_kv_row); key/value
// (T, Hkv, D), rows strided. Slot s of a head is row s of that head's
// (num_blocks * block_size, row) matrix.
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping) {
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous 5-d");
  const KvFormat format = kv_format(kv_cache.scalar_type());
  const bool quantized = format != KvFormat::kNone;
  const bool rounded = key.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
              (quantized || rounded || key.scalar_type() == kv_cache.scalar_type()),
              "key/value/kv_cache dtypes differ");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = key.size(0), kv_heads = kv_cache.size(1);
  const int64_t row = kv_cache.size(4), head_dim = quantized ? row - kKvScaleBytes : row;
  TORCH_CHECK(key.size(2) == head_dim && value.size(2) == head_dim,
              "key/value head_dim does not match kv_cache");
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  LOOM_DISPATCH(key.scalar_type(), "write_kv_cache", [&] {
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    char* quantized_cache = quantized ? static_cast<char*>(kv_cache.data_ptr()) : nullptr;
    scalar_t* cache = quantized || rounded ? nullptr : kv_cache.data_ptr<scalar_t>();
    c10::BFloat16* bf16_cache = rounded ? kv_cache.data_ptr<c10::BFloat16>() : nullptr;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " out of range");
      for (int64_t h = 0; h < kv_heads; ++h) {
        const scalar_t* k = kp + t * key.stride(0) + h * key.stride(1);
        const scalar_t* v = vp + t * value.stride(0) + h * value.stride(1);
        const int64_t k_row = (h * num_slots + slot) * row;
        const int64_t v_row = ((kv_heads + h) * num_slots + slot) * row;
        if (quantized) {
          quantize_kv_row(k, quantized_cache + k_row, head_dim, format);
          quantize_kv_row(v, quantized_cache + v_row, head_dim, format);
        } else if (rounded) {
          for (int64_t d = 0; d < head_dim; ++d) {
            bf16_cache[k_row + d] = from_float<c10::BFloat16>(to_float(k[d]));
            bf16_cache[v_row + d] = from_float<c10::BFloat16>(to_float(v[d]));
          }
        } else {
          std::memcpy(cache + k_row, k, head_dim * sizeof(scalar_t));
          std::memcpy(cache + v_row, v, head_dim * sizeof(scalar_t));
        }
      }
    }
  });
}

}  // namespace loom
