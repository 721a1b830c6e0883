// Writing a step's new K/V into the paged cache.

#include "common.h"
#include "ops.h"

namespace loom {

// kv_cache (2, Hkv, num_blocks, block_size, D); key/value (T, Hkv, D), rows strided.
// Slot s of a head is row s of that head's (num_blocks * block_size, D) matrix.
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping) {
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous 5-d");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
              value.scalar_type() == kv_cache.scalar_type(), "key/value/kv_cache dtypes differ");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = key.size(0), kv_heads = kv_cache.size(1);
  const int64_t head_dim = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  LOOM_DISPATCH(kv_cache.scalar_type(), "write_kv_cache", [&] {
    scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " out of range");
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(cache + (h * num_slots + slot) * head_dim,
                    kp + t * key.stride(0) + h * key.stride(1), head_dim * sizeof(scalar_t));
        std::memcpy(cache + ((kv_heads + h) * num_slots + slot) * head_dim,
                    vp + t * value.stride(0) + h * value.stride(1), head_dim * sizeof(scalar_t));
      }
    }
  });
}

}  // namespace loom
