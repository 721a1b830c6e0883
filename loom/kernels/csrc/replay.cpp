// A recorded forward, replayed (replay.h), and the few ATen operations a recording
// holds beside loom's kernels: a view of an input or of a kernel's result, the copy a
// dtype conversion makes, elementwise add/sub/mul and an embedding's row gather, each
// written into the planned buffer the eager forward's result had.

#include "replay.h"

#include <ATen/ops/add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sub.h>

namespace loom {

std::vector<at::Tensor> ReplayProgram::run(std::vector<at::Tensor> inputs) const {
  TORCH_CHECK(static_cast<int64_t>(inputs.size()) == num_inputs_, "ReplayProgram: ",
              inputs.size(), " inputs for a forward recorded with ", num_inputs_);
  ReplayFrame frame;
  frame.slots.resize(num_slots_);
  for (int64_t i = 0; i < num_inputs_; ++i) frame.slots[i] = std::move(inputs[i]);
  for (const auto& step : steps_) step(frame);
  std::vector<at::Tensor> outputs;
  outputs.reserve(outputs_.size());
  for (const auto& ref : outputs_)
    outputs.push_back(ref.slot >= 0 ? frame.slots[ref.slot] : ref.constant.clone());
  return outputs;
}

namespace replay_ops {

at::Tensor as_strided(const at::Tensor& src, std::vector<int64_t> sizes,
                      std::vector<int64_t> strides, int64_t offset) {
  return src.as_strided(sizes, strides, src.storage_offset() + offset);
}

void copy(at::Tensor dst, const at::Tensor& src) { dst.copy_(src); }

void add_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::add_out(out, a, b); }
void sub_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::sub_out(out, a, b); }
void mul_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::mul_out(out, a, b); }
void add_(at::Tensor self, const at::Tensor& other) { self.add_(other); }
void sub_(at::Tensor self, const at::Tensor& other) { self.sub_(other); }
void mul_(at::Tensor self, const at::Tensor& other) { self.mul_(other); }

void index_select_out(at::Tensor out, const at::Tensor& src, int64_t dim,
                      const at::Tensor& index) {
  at::index_select_out(out, src, dim, index);
}

}  // namespace replay_ops
}  // namespace loom
