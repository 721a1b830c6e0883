// The Python module: every kernel of ops.h and bf16_gemm.h, registered with pybind11.
// It includes torch's pybind11 glue (Tensor <-> torch.Tensor) and not
// <torch/extension.h>, which adds the whole C++ frontend: ~15 s of compiler time
// instead of ~35 s, for the only file that needs either.

#include "bf16_gemm.h"
#include "common.h"
#include "experts.h"
#include "ops.h"
#include "quant_gemm.h"
#include "replay.h"

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// The instruction sets this build has, for set_isa (see common.h).
std::vector<std::string> isas() {
  if (LOOM_HAVE_AVX512_BF16) return {"generic", "avx512"};
  return {"generic"};
}

std::string isa() { return loom::use_avx512() ? "avx512" : "generic"; }

// For tests only: which path the kernels with two take from now on; returns the one
// they took before, for the caller to put back.
std::string set_isa(const std::string& name) {
  const auto available = isas();
  TORCH_CHECK(std::find(available.begin(), available.end(), name) != available.end(),
              "set_isa: '", name, "' is not an instruction set of this build; it has ",
              c10::Join(", ", available));
  const std::string previous = isa();
  loom::force_generic_isa.store(name == "generic", std::memory_order_relaxed);
  return previous;
}

// The handle of a linear weight the experts multiply by (experts.h).
void bind_experts(py::module& m) {
  py::class_<loom::LinearWeight>(m, "LinearWeight", "a linear layer's weight for the experts")
      .def_static("bf16", &loom::LinearWeight::bf16, "from pack_bf16_weight's panels",
                  py::arg("packed"))
      .def_static("quantized", &loom::LinearWeight::of_quantized, "from a QuantizedWeight",
                  py::arg("weight"))
      .def_static("quantized_parts", &loom::LinearWeight::of_parts,
                  "from QuantizedWeights of consecutive runs of output rows (several formats)",
                  py::arg("parts"))
      .def_property_readonly("is_quantized",
                             [](const loom::LinearWeight& w) { return !w.is_bf16(); });
}

// ---------------------------------------------------------------- replay (replay.h)
//
// Every kernel bound with def_kernel is also registered for replay under its name: a
// recorded call (the kernel's name, its arguments as the recording saw them, the slots
// its results go to) becomes a ReplayStep that calls the C++ function directly. A tensor
// argument is a ReplaySlot (an input, a result of an earlier step) or a constant; every
// other argument is a constant, converted once, here, to the C++ type the kernel takes.

struct ReplaySlot {
  int64_t index;
};

using ReplayBuilder =
    std::function<loom::ReplayStep(const py::sequence& args, const std::vector<int64_t>& outputs)>;

std::unordered_map<std::string, ReplayBuilder>& replay_kernels() {
  static std::unordered_map<std::string, ReplayBuilder> kernels;
  return kernels;
}

loom::TensorRef tensor_ref(const py::handle& arg) {
  loom::TensorRef ref;
  if (py::isinstance<ReplaySlot>(arg))
    ref.slot = arg.cast<ReplaySlot>().index;
  else
    ref.constant = arg.cast<at::Tensor>();
  return ref;
}

// How one argument of type T is had at replay: a constant (any type), or a slot
// (tensors only).
template <typename T>
struct ReplayArg {
  T value;
  static ReplayArg make(const py::handle& arg, const std::string& kernel, size_t index) {
    TORCH_CHECK(!py::isinstance<ReplaySlot>(arg), "replay: argument ", index, " of ", kernel,
                " is not a tensor and cannot come from a slot");
    return {arg.cast<T>()};
  }
  const T& get(const loom::ReplayFrame&) const { return value; }
};

template <>
struct ReplayArg<at::Tensor> {
  loom::TensorRef ref;
  static ReplayArg make(const py::handle& arg, const std::string&, size_t) {
    return {tensor_ref(arg)};
  }
  const at::Tensor& get(const loom::ReplayFrame& frame) const { return ref.get(frame); }
};

template <>
struct ReplayArg<c10::optional<at::Tensor>> {
  c10::optional<loom::TensorRef> ref;
  static ReplayArg make(const py::handle& arg, const std::string&, size_t) {
    if (arg.is_none()) return {};
    return {tensor_ref(arg)};
  }
  c10::optional<at::Tensor> get(const loom::ReplayFrame& frame) const {
    if (!ref) return c10::nullopt;
    return ref->get(frame);
  }
};

void store(at::Tensor result, const std::vector<int64_t>& outputs, loom::ReplayFrame& frame) {
  if (!outputs.empty() && outputs[0] >= 0) frame.slots[outputs[0]] = std::move(result);
}

void store(std::vector<at::Tensor> results, const std::vector<int64_t>& outputs,
           loom::ReplayFrame& frame) {
  for (size_t i = 0; i < outputs.size() && i < results.size(); ++i)
    if (outputs[i] >= 0) frame.slots[outputs[i]] = std::move(results[i]);
}

template <typename R, typename... A, size_t... I>
loom::ReplayStep make_step(R (*fn)(A...), const std::string& name, const py::sequence& args,
                           const std::vector<int64_t>& outputs, std::index_sequence<I...>) {
  TORCH_CHECK(args.size() == sizeof...(A), "replay: ", name, " takes ", sizeof...(A),
              " arguments, the recording has ", args.size());
  auto sources = std::make_tuple(ReplayArg<std::decay_t<A>>::make(args[I], name, I)...);
  return [fn, sources = std::move(sources), outputs](loom::ReplayFrame& frame) {
    if constexpr (std::is_void_v<R>) {
      fn(std::get<I>(sources).get(frame)...);
    } else {
      store(fn(std::get<I>(sources).get(frame)...), outputs, frame);
    }
  };
}

template <typename R, typename... A>
void register_replay(const std::string& name, R (*fn)(A...)) {
  static_assert(std::is_void_v<R> || std::is_same_v<R, at::Tensor> ||
                    std::is_same_v<R, std::vector<at::Tensor>>,
                "a replayed kernel returns nothing, a tensor or a list of tensors");
  replay_kernels()[name] = [fn, name](const py::sequence& args,
                                      const std::vector<int64_t>& outputs) {
    return make_step(fn, name, args, outputs, std::index_sequence_for<A...>{});
  };
}

// While a forward is recorded (kernel_replay.py), every kernel bound with def_kernel
// tells the recorder each call after it ran: its name, its arguments in its parameters'
// order (a tensor as the Python object the caller passed), its result. Told here, at
// the call, however the caller got hold of the function.
std::atomic<bool> recording{false};

py::object& replay_recorder() {
  static py::object* recorder = new py::object();  // never destroyed: outlives the module
  return *recorder;
}

void set_replay_recorder(py::object recorder) {
  replay_recorder() = std::move(recorder);
  recording.store(!replay_recorder().is_none(), std::memory_order_relaxed);
}

// `result`: a pointer to the kernel's result, null for a kernel that returns nothing
template <typename R, typename... A>
void tell_recorder(const char* name, const R* result, const A&... args) {
  py::gil_scoped_acquire gil;
  if (!replay_recorder() || replay_recorder().is_none()) return;
  replay_recorder()(name, py::make_tuple(args...),
                    result ? py::cast(*result) : py::object(py::none()));
}

// m.def of a kernel (releasing the GIL while it runs) that a recording may hold: it is
// registered for replay too, under its name, listed in the module's `replay_kernels`.
template <typename R, typename... A, typename... Extra>
void def_kernel(py::module& m, const char* name, R (*fn)(A...), const Extra&... extra) {
  m.def(
      name,
      [fn, name](A... args) -> R {
        if constexpr (std::is_void_v<R>) {
          fn(args...);
          if (recording.load(std::memory_order_relaxed))
            tell_recorder(name, static_cast<const int*>(nullptr), args...);
        } else {
          R result = fn(args...);
          if (recording.load(std::memory_order_relaxed)) tell_recorder(name, &result, args...);
          return result;
        }
      },
      extra..., py::call_guard<py::gil_scoped_release>());
  register_replay(name, fn);
  py::list names = m.attr("replay_kernels");
  names.append(name);
}

void bind_replay(py::module& m) {
  using namespace loom::replay_ops;
  m.def("set_replay_recorder", &set_replay_recorder,
        "recorder(name, args, result) told of every kernel call from now on; None: no more",
        py::arg("recorder"));
  py::class_<ReplaySlot>(m, "ReplaySlot", "a tensor of a replay: an input or a kernel's result")
      .def(py::init<int64_t>(), py::arg("index"))
      .def_readonly("index", &ReplaySlot::index);
  // the ATen operations a recording holds (replay.h), for replay only: "aten.<name>"
  register_replay("aten.as_strided", &as_strided);
  register_replay("aten.copy", &copy);
  register_replay("aten.add_out", &add_out);
  register_replay("aten.sub_out", &sub_out);
  register_replay("aten.mul_out", &mul_out);
  register_replay("aten.add_", &add_);
  register_replay("aten.sub_", &sub_);
  register_replay("aten.mul_", &mul_);
  register_replay("aten.index_select_out", &index_select_out);
  py::class_<loom::ReplayProgram>(m, "ReplayProgram",
                                  "a recorded forward's kernel calls, run again from C++")
      .def(py::init([](int64_t num_slots, int64_t num_inputs, const py::list& steps,
                       const py::list& outputs) {
             std::vector<loom::ReplayStep> built;
             built.reserve(steps.size());
             for (const auto& step : steps) {
               auto call = step.cast<py::tuple>();  // (name, args, output slots)
               const auto name = call[0].cast<std::string>();
               auto found = replay_kernels().find(name);
               TORCH_CHECK(found != replay_kernels().end(), "replay: no kernel ", name);
               built.push_back(found->second(call[1].cast<py::sequence>(),
                                             call[2].cast<std::vector<int64_t>>()));
             }
             std::vector<loom::TensorRef> refs;
             for (const auto& output : outputs) refs.push_back(tensor_ref(output));
             return loom::ReplayProgram(num_slots, num_inputs, std::move(built),
                                        std::move(refs));
           }),
           "num_slots (inputs first), num_inputs, steps [(kernel, args, result slots)], "
           "outputs [ReplaySlot or tensor]",
           py::arg("num_slots"), py::arg("num_inputs"), py::arg("steps"), py::arg("outputs"))
      .def("run", &loom::ReplayProgram::run, py::call_guard<py::gil_scoped_release>(),
           "inputs -> outputs, every step run in order", py::arg("inputs"))
      .def_property_readonly("num_steps", &loom::ReplayProgram::num_steps);
}

// Weight-only quantized matmul (quant_gemm.h).
void bind_quant_gemm(py::module& m) {
  py::class_<loom::QuantizedWeight>(m, "QuantizedWeight",
                                    "a quantized linear weight in quantized_linear's layout")
      // writable: a layer in several formats moves its parts' bytes into one buffer
      .def_readwrite("data", &loom::QuantizedWeight::data)
      .def_readonly("out_features", &loom::QuantizedWeight::out_features)
      .def_readonly("in_features", &loom::QuantizedWeight::in_features)
      .def_readonly("bits", &loom::QuantizedWeight::bits)
      .def_readonly("group_size", &loom::QuantizedWeight::group_size)
      .def_readonly("asymmetric", &loom::QuantizedWeight::asymmetric)
      .def_readonly("float_scales", &loom::QuantizedWeight::float_scales)
      .def_readonly("two_level", &loom::QuantizedWeight::two_level)
      .def_property_readonly("nbytes", &loom::QuantizedWeight::nbytes);
  m.def("quant_gemm_available", &loom::quant_gemm_available,
        "whether quantized_linear runs here (AVX512-BF16)");
  m.def("quant_gemm_rounds_x", &loom::quant_gemm_rounds_x,
        "whether quantized_linear rounds x to int16 for this many rows now", py::arg("rows"));
  m.def("pack_quantized_weight", &loom::pack_quantized_weight,
        "values (N, K) uint8, scales (N, groups) [, offsets] [, two-level super_scales "
        "[, super_offsets] (N, K / 256)] -> QuantizedWeight",
        py::arg("values"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
        py::arg("super_scales") = py::none(), py::arg("super_offsets") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("unpack_quantized_weight", &loom::unpack_quantized_weight,
        "QuantizedWeight -> [values, scales, offsets, super_scales, super_offsets] (None where "
        "absent)", py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  def_kernel(m, "dequantize_rows", &loom::dequantize_rows, "out = rows ids of W, dequantized",
             py::arg("out"), py::arg("weight"), py::arg("ids"));
  def_kernel(m, "quantized_linear", &loom::quantized_linear,
             "out = x @ W^T (+ bias), W quantized", py::arg("out"), py::arg("x"),
             py::arg("weight"), py::arg("bias") = py::none());
}

}  // namespace

// Every kernel releases the GIL while it runs, as torch's own ops do: a whole layer
// stack can run for seconds on a large model, and the worker's heartbeat thread must
// keep writing meanwhile (pybind converts arguments and results with the GIL held).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.attr("replay_kernels") = py::list();
  def_kernel(m, "rms_norm", &loom::rms_norm, "RMSNorm of each row", py::arg("x"),
             py::arg("weight"), py::arg("eps"));
  def_kernel(m, "fused_add_rms_norm", &loom::fused_add_rms_norm,
             "residual += x; x = rms_norm(residual)", py::arg("x"), py::arg("residual"),
             py::arg("weight"), py::arg("eps"));
  def_kernel(m, "add_rms_norm", &loom::add_rms_norm, "residual += x; out = rms_norm(residual)",
             py::arg("out"), py::arg("x"), py::arg("residual"), py::arg("weight"),
             py::arg("eps"));
  def_kernel(m, "silu_and_mul", &loom::silu_and_mul, "silu(gate) * up", py::arg("x"));
  def_kernel(m, "rotary_embedding", &loom::rotary_embedding, "neox rotary, in place",
             py::arg("x"), py::arg("positions"), py::arg("cos_sin_cache"));
  def_kernel(m, "write_kv_cache", &loom::write_kv_cache, "copy new K/V into their cache slots",
             py::arg("key"), py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"));
  m.def("segment_attention_available", &loom::segment_attention_available,
        "whether segment_attention runs here (AVX512-BF16)");
  m.def("segment_attention", &loom::segment_attention,
        "bf16 attention of each row over every row of its segment (a vision tower's "
        "windows and images), none outside: out (rows, heads, head_dim)",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lengths"),
        py::arg("scale"), release());
  def_kernel(m, "paged_attention", &loom::paged_attention, "causal attention over paged K/V",
             py::arg("out"), py::arg("query"), py::arg("kv_cache"), py::arg("block_table"),
             py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
             py::arg("max_query_len"));
  def_kernel(m, "paged_attention_windowed", &loom::paged_attention_windowed,
             "causal attention over paged K/V, each query seeing its last sliding_window keys",
             py::arg("out"), py::arg("query"), py::arg("kv_cache"), py::arg("block_table"),
             py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
             py::arg("max_query_len"), py::arg("sliding_window"));
  def_kernel(m, "moba_update_block_means", &loom::moba_update_block_means,
             "each MoBA block completed by the step: its mean key, at its last cache block",
             py::arg("means"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"),
             py::arg("query_start_loc"), py::arg("moba_block_size"));
  def_kernel(m, "moba_attention", &loom::moba_attention,
             "MoBA over paged K/V: own block and the topk - 1 best-gated earlier blocks",
             py::arg("out"), py::arg("query"), py::arg("kv_cache"), py::arg("means"),
             py::arg("block_table"), py::arg("seq_lens"), py::arg("query_start_loc"),
             py::arg("scale"), py::arg("moba_block_size"), py::arg("topk"),
             py::arg("min_seq_len"));
  m.def("bf16_gemm_available", &loom::bf16_gemm_available,
        "whether bf16_linear runs here (AVX512-BF16)");
  m.def("bf16_amx_available", &loom::bf16_amx_available,
        "whether bf16_linear runs many rows on the AMX tiles here");
  m.def("set_bf16_amx", &loom::set_bf16_amx,
        "allow (the default) or forbid the AMX tiles (LOOM_AMX, loom/envs.py)");
  m.def("pack_bf16_weight", &loom::pack_bf16_weight, "a linear weight in bf16_linear's layout",
        release());
  def_kernel(m, "bf16_gather_rows", &loom::bf16_gather_rows,
             "out = rows ids of the (n, K) weight held as pack_bf16_weight's panels",
             py::arg("out"), py::arg("packed"), py::arg("ids"), py::arg("n"));
  def_kernel(m, "bf16_linear", &loom::bf16_linear, "out = x @ W^T (+ bias), bf16, W packed",
             py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  def_kernel(
      m, "bf16_linear_group",
      +[](std::vector<at::Tensor> outs, std::vector<at::Tensor> xs,
          std::vector<at::Tensor> packed) {
        TORCH_CHECK(outs.size() == xs.size() && xs.size() == packed.size(),
                    "bf16_linear_group: as many outs as xs as packed weights");
        std::vector<loom::Bf16Matmul> matmuls;
        for (size_t i = 0; i < outs.size(); ++i)
          matmuls.push_back(loom::bf16_matmul(outs[i], xs[i], packed[i]));
        loom::bf16_linear_group(matmuls);
      },
      "outs[i] = xs[i] @ W_i^T for each i, bf16, in one parallel region (each as bf16_linear)",
      py::arg("outs"), py::arg("xs"), py::arg("packed"));
  def_kernel(m, "moe_route", &loom::moe_route,
             "a mixture of experts' router: x (T, H) bf16 -> [weights (T, K) float32, ids (T, K)]",
             py::arg("x"), py::arg("router"), py::arg("correction_bias"), py::arg("top_k"),
             py::arg("scoring"), py::arg("renormalize"), py::arg("renormalize_min"));
  def_kernel(m, "lora_add", &loom::lora_add,
             "y (T, N) += each row's LoRA adapter (x_t a[s]^T) b[s], s = token_slot[t] "
             "(-1: none); a (S, R, K), b (S, R, N); part_sizes: a fused layer's outputs, "
             "part p reading b's rank rows [p R/P, (p+1) R/P) only ([]: one part)",
             py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("token_slot"),
             py::arg("active"), py::arg("part_sizes"));
  def_kernel(m, "lora_embedding_add", &loom::lora_embedding_add,
             "y (T, D) += each row's embedding LoRA a_t[s][ids[t]] b[s], s = token_slot[t] "
             "(-1: none); a_t (S, V, R), b (S, R, D)", py::arg("y"), py::arg("ids"),
             py::arg("a_t"), py::arg("b"), py::arg("token_slot"), py::arg("active"));
  def_kernel(m, "argmax_rows", &loom::argmax_rows,
             "logits (R, V) float32 -> (R,) int64, each row's first largest (torch.argmax)",
             py::arg("logits"));
  bind_experts(m);
  def_kernel(m, "mixture_of_experts", &loom::mixture_of_experts,
             "a MoE layer's routed experts on x (T, H) bf16, one rank holding them all: routed "
             "over `router` (E, H) float32, the counts added to tokens_per_expert (and "
             "step_tokens), each chosen expert's w13 and w2 (LinearWeights)",
             py::arg("x"), py::arg("router"), py::arg("correction_bias"),
             py::arg("expert_w13"), py::arg("expert_w2"), py::arg("tokens_per_expert"),
             py::arg("step_tokens"), py::arg("top_k"), py::arg("scoring"),
             py::arg("renormalize"), py::arg("renormalize_min"),
             py::arg("intermediate_size"));
  bind_quant_gemm(m);
  bind_replay(m);
  m.def("isas", &isas, "the instruction sets this build has: generic, and avx512 with AVX512-BF16");
  m.def("isa", &isa, "the instruction set the kernels with two paths take now");
  m.def("set_batch_invariant",
        [](bool on) {
          const bool previous = loom::batch_invariant();
          loom::batch_invariance.store(on, std::memory_order_relaxed);
          return previous;
        },
        "whether every kernel gives a row the same bits whatever the other rows are "
        "(LOOM_BATCH_INVARIANT; set when the module loads, and by tests); returns the "
        "setting before", py::arg("on"));
  m.def("batch_invariant", &loom::batch_invariant,
        "whether the kernels give a row the same bits whatever the other rows are");
  m.def("set_isa", &set_isa,
        "for tests only: make the kernels with two paths (bf16 SiLU*mul, paged "
        "attention, LoRA) take 'generic' or 'avx512'; returns the previous one",
        py::arg("name"));
}
