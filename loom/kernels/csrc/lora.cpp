// LoRA adapters on a linear layer's output, batched (loom/model/layers/lora.py): each
// row t of x whose request runs adapter slot s = token_slot[t] (>= 0; -1: the base)
// gets (x_t A_s^T) B_s^T added to its row of y. Rows are grouped by slot (Punica's
// segments): a run of consecutive rows is one shrink and one expand product on views, a
// scattered group gathered and added back. A step without adapters returns after one
// pass over token_slot, so the base model's rows cost nothing more.

#include "ops.h"

#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/from_blob.h>

#include <map>
#include <vector>

namespace loom {

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& token_slot, const at::Tensor& active) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add: x (T, K) and y (T, N) must have the same rows");
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.numel() == x.size(0),
              "lora_add: token_slot must be (T,) int64, one slot per row of x");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                  a.size(2) == x.size(1) && b.size(1) == y.size(1) && a.size(1) == b.size(2),
              "lora_add: a (S, R, K) and b (S, N, R) must fit x (T, K) and y (T, N)");
  TORCH_CHECK(active.scalar_type() == at::kBool && active.numel() == a.size(0),
              "lora_add: active must be (S,) bool");
  const int64_t* slot_of = token_slot.data_ptr<int64_t>();
  const bool* is_active = active.data_ptr<bool>();
  const int64_t rows = x.size(0), slots = a.size(0);
  std::map<int64_t, std::vector<int64_t>> groups;  // slot -> its rows, in order
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slot_of[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, "lora_add: row ", t, " names slot ", slot, " of ", slots);
    if (is_active[slot]) groups[slot].push_back(t);
  }
  for (const auto& [slot, ids] : groups) {
    const auto count = static_cast<int64_t>(ids.size());
    const bool run = ids.back() - ids.front() + 1 == count;  // consecutive rows
    at::Tensor index;
    at::Tensor xs;
    if (run) {
      xs = x.narrow(0, ids.front(), count);
    } else {
      index = at::from_blob(const_cast<int64_t*>(ids.data()), {count}, at::kLong).clone();
      xs = at::index_select(x, 0, index);
    }
    auto shrunk = at::mm(xs.to(a.scalar_type()), a[slot].t());
    auto delta = at::mm(shrunk, b[slot].t()).to(y.scalar_type());
    if (run)
      y.narrow(0, ids.front(), count).add_(delta);
    else
      y.index_add_(0, index, delta);
  }
}

}  // namespace loom
