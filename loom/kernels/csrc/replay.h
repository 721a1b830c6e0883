// A recorded forward, replayed: the flat list of kernel calls one eager forward made
// (loom/model/kernel_replay.py records it), run again from C++ with no Python between
// them, as a CUDA graph replays a captured step. It knows kernels, not models: each
// step is one call of a kernel this module binds (torch_bindings.cpp registers every
// kernel it binds for replay as it binds it), its arguments either constants fixed at
// record time (weights, KV caches, sizes, the planned buffers of the forward's
// temporaries and their views) or slots: the forward's inputs and the tensors kernels
// returned, which change from one replay to the next.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace loom {

// The tensors of one replay: the inputs first, then each kernel's results.
struct ReplayFrame {
  std::vector<at::Tensor> slots;
};

// One recorded kernel call, its arguments bound.
using ReplayStep = std::function<void(ReplayFrame&)>;

// A tensor argument or result: a slot of the frame, or a constant.
struct TensorRef {
  int64_t slot = -1;
  at::Tensor constant;
  const at::Tensor& get(const ReplayFrame& frame) const {
    return slot >= 0 ? frame.slots[slot] : constant;
  }
};

class ReplayProgram {
 public:
  ReplayProgram(int64_t num_slots, int64_t num_inputs, std::vector<ReplayStep> steps,
                std::vector<TensorRef> outputs)
      : num_slots_(num_slots), num_inputs_(num_inputs), steps_(std::move(steps)),
        outputs_(std::move(outputs)) {}

  // inputs (as recorded: the same shapes) -> the recorded forward's outputs, each a new
  // tensor (a copy where it lies in the planned buffers, which the next replay reuses)
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) const;

  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }

 private:
  int64_t num_slots_, num_inputs_;
  std::vector<ReplayStep> steps_;
  std::vector<TensorRef> outputs_;
};

// The ATen operations a recording holds beside loom's kernels (replay.cpp): each
// writes where the eager forward's result lay (a planned buffer, a view of it).
namespace replay_ops {
// a view of `src` (an input, or a kernel's result): `offset` from src's own
at::Tensor as_strided(const at::Tensor& src, std::vector<int64_t> sizes,
                      std::vector<int64_t> strides, int64_t offset);
void copy(at::Tensor dst, const at::Tensor& src);
void add_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b);
void sub_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b);
void mul_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b);
void add_(at::Tensor self, const at::Tensor& other);
void sub_(at::Tensor self, const at::Tensor& other);
void mul_(at::Tensor self, const at::Tensor& other);
void index_select_out(at::Tensor out, const at::Tensor& src, int64_t dim,
                      const at::Tensor& index);
}  // namespace replay_ops

}  // namespace loom
