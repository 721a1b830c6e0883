// LoRA adapters on a linear layer's output, batched (loom/model/layers/lora.py): each
// row t of x whose request runs adapter slot s = token_slot[t] (>= 0; -1: the base)
// gets (x_t A_s^T) B_s^T added to its row of y. Rows are grouped by slot (Punica's
// segments): a run of consecutive rows is one shrink and one expand product on views, a
// scattered group gathered and added back. A step without adapters returns after one
// pass over token_slot, so the base model's rows cost nothing more.
//
// The token embeddings' adapter (PEFT's lora_embedding_A/B) is the same with a gather
// for the shrink: row t gets B_s A_s^T[ids[t]], A held transposed (V, R) per slot.

#include "ops.h"

#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/from_blob.h>

#include <map>
#include <vector>

namespace loom {
namespace {

// slot -> its rows, in order, for each active slot some row runs
std::map<int64_t, std::vector<int64_t>> group_rows(const char* name, const at::Tensor& token_slot,
                                                   const at::Tensor& active, int64_t rows,
                                                   int64_t slots) {
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.numel() == rows, name,
              ": token_slot must be (T,) int64, one slot per row");
  TORCH_CHECK(active.scalar_type() == at::kBool && active.numel() == slots, name,
              ": active must be (S,) bool");
  const int64_t* slot_of = token_slot.data_ptr<int64_t>();
  const bool* is_active = active.data_ptr<bool>();
  std::map<int64_t, std::vector<int64_t>> groups;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slot_of[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, name, ": row ", t, " names slot ", slot, " of ", slots);
    if (is_active[slot]) groups[slot].push_back(t);
  }
  return groups;
}

bool consecutive(const std::vector<int64_t>& ids) {
  return ids.back() - ids.front() + 1 == static_cast<int64_t>(ids.size());
}

at::Tensor index_of(const std::vector<int64_t>& ids) {
  return at::from_blob(const_cast<int64_t*>(ids.data()), {static_cast<int64_t>(ids.size())},
                       at::kLong)
      .clone();
}

// y's rows `ids` += delta (one row each, in order)
void add_rows(at::Tensor& y, const std::vector<int64_t>& ids, const at::Tensor& index,
              const at::Tensor& delta) {
  if (!index.defined())
    y.narrow(0, ids.front(), static_cast<int64_t>(ids.size())).add_(delta);
  else
    y.index_add_(0, index, delta);
}

}  // namespace

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& token_slot, const at::Tensor& active) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add: x (T, K) and y (T, N) must have the same rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                  a.size(2) == x.size(1) && b.size(1) == y.size(1) && a.size(1) == b.size(2),
              "lora_add: a (S, R, K) and b (S, N, R) must fit x (T, K) and y (T, N)");
  const auto groups = group_rows("lora_add", token_slot, active, x.size(0), a.size(0));
  for (const auto& [slot, ids] : groups) {
    const auto count = static_cast<int64_t>(ids.size());
    at::Tensor index;
    at::Tensor xs;
    if (consecutive(ids)) {
      xs = x.narrow(0, ids.front(), count);
    } else {
      index = index_of(ids);
      xs = at::index_select(x, 0, index);
    }
    auto shrunk = at::mm(xs.to(a.scalar_type()), a[slot].t());
    add_rows(y, ids, index, at::mm(shrunk, b[slot].t()).to(y.scalar_type()));
  }
}

void lora_embedding_add(at::Tensor y, const at::Tensor& ids, const at::Tensor& a_t,
                        const at::Tensor& b, const at::Tensor& token_slot,
                        const at::Tensor& active) {
  TORCH_CHECK(y.dim() == 2 && ids.dim() == 1 && ids.size(0) == y.size(0) &&
                  ids.scalar_type() == at::kLong,
              "lora_embedding_add: ids (T,) int64 and y (T, D) must have the same rows");
  TORCH_CHECK(a_t.dim() == 3 && b.dim() == 3 && a_t.size(0) == b.size(0) &&
                  b.size(1) == y.size(1) && a_t.size(2) == b.size(2),
              "lora_embedding_add: a_t (S, V, R) and b (S, D, R) must fit y (T, D)");
  const auto groups = group_rows("lora_embedding_add", token_slot, active, y.size(0),
                                 a_t.size(0));
  for (const auto& [slot, rows] : groups) {
    const auto count = static_cast<int64_t>(rows.size());
    at::Tensor index;
    at::Tensor token_ids;
    if (consecutive(rows)) {
      token_ids = ids.narrow(0, rows.front(), count);
    } else {
      index = index_of(rows);
      token_ids = at::index_select(ids, 0, index);
    }
    auto shrunk = at::index_select(a_t[slot], 0, token_ids);  // (n, R): A's columns
    add_rows(y, rows, index, at::mm(shrunk, b[slot].t()).to(y.scalar_type()));
  }
}

}  // namespace loom
