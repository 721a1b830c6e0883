// The Python module: every kernel of ops.h and bf16_gemm.h, registered with pybind11.
// It includes torch's pybind11 glue (Tensor <-> torch.Tensor) and not
// <torch/extension.h>, which adds the whole C++ frontend: ~15 s of compiler time
// instead of ~35 s, for the only file that needs either.

#include "bf16_gemm.h"
#include "common.h"
#include "decoder_stack.h"
#include "ops.h"
#include "quant_gemm.h"

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>
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
  m.def("dequantize_rows", &loom::dequantize_rows, "out = rows ids of W, dequantized",
        py::arg("out"), py::arg("weight"), py::arg("ids"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quantized_linear", &loom::quantized_linear, "out = x @ W^T (+ bias), W quantized",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}

// The decoder stack's schema, field by field from decoder_stack.h, each under its C++
// name; `fields` lists them for the Python side to check its roles against.
void bind_decoder_stack(py::module& m) {
  using loom::DecoderLayerWeights;
  using loom::DecoderStackOptions;
  py::class_<loom::LinearWeight>(m, "LinearWeight", "a linear layer's weight for the stack")
      .def_static("bf16", &loom::LinearWeight::bf16, "from pack_bf16_weight's panels",
                  py::arg("packed"))
      .def_static("quantized", &loom::LinearWeight::of_quantized, "from a QuantizedWeight",
                  py::arg("weight"))
      .def_static("quantized_parts", &loom::LinearWeight::of_parts,
                  "from QuantizedWeights of consecutive runs of output rows (several formats)",
                  py::arg("parts"))
      .def_property_readonly("is_quantized",
                             [](const loom::LinearWeight& w) { return !w.is_bf16(); });
  py::class_<DecoderLayerWeights> weights(m, "DecoderLayerWeights",
                                          "one decoder layer's weights, by role");
  weights.def(py::init<>());
  std::vector<std::string> weight_fields;
#define LOOM_BIND_FIELD(name, doc)                               \
  weights.def_readwrite(#name, &DecoderLayerWeights::name, doc); \
  weight_fields.push_back(#name);
  LOOM_DECODER_LAYER_REQUIRED(LOOM_BIND_FIELD)
  LOOM_DECODER_LAYER_LINEARS(LOOM_BIND_FIELD)
  LOOM_DECODER_LAYER_OPTIONAL_LINEARS(LOOM_BIND_FIELD)
  LOOM_DECODER_LAYER_OPTIONAL(LOOM_BIND_FIELD)
#undef LOOM_BIND_FIELD
#define LOOM_BIND_MOE_FIELD(type, name, doc)                      \
  weights.def_readwrite(#name, &DecoderLayerWeights::name, doc); \
  weight_fields.push_back(#name);
  LOOM_DECODER_LAYER_MOE(LOOM_BIND_MOE_FIELD)
#undef LOOM_BIND_MOE_FIELD
  weights.attr("fields") = py::tuple(py::cast(weight_fields));
  std::vector<std::string> required;
#define LOOM_LIST_REQUIRED(name, doc) required.push_back(#name);
  LOOM_DECODER_LAYER_REQUIRED(LOOM_LIST_REQUIRED)
  LOOM_DECODER_LAYER_LINEARS(LOOM_LIST_REQUIRED)
#undef LOOM_LIST_REQUIRED
  weights.attr("required") = py::tuple(py::cast(required));

  py::class_<DecoderStackOptions> options(m, "DecoderStackOptions",
                                          "options of the whole decoder stack");
  options.def(py::init<>());
  std::vector<std::string> option_fields;
#define LOOM_BIND_OPTION(type, name, doc)                         \
  options.def_readwrite(#name, &DecoderStackOptions::name, doc); \
  option_fields.push_back(#name);
  LOOM_DECODER_STACK_OPTIONS(LOOM_BIND_OPTION)
#undef LOOM_BIND_OPTION
  options.attr("fields") = py::tuple(py::cast(option_fields));

  m.def(
      "mixture_of_experts",
      [](const at::Tensor& x, const DecoderLayerWeights& w, const DecoderStackOptions& o) {
        TORCH_CHECK(w.router && w.tokens_per_expert,
                    "mixture_of_experts: the weights need a router and tokens_per_expert");
        return loom::mixture_of_experts(x, *w.router, w.correction_bias, w.expert_w13,
                                        w.expert_w2, *w.tokens_per_expert, w.step_tokens,
                                        o.top_k, o.scoring, o.renormalize, o.renormalize_min,
                                        o.moe_intermediate_size);
      },
      py::call_guard<py::gil_scoped_release>(),
      "a MoE layer's routed experts on x (T, H) bf16, one rank holding them all (the "
      "module path's and the stack's one implementation): the MoE fields of `weights` "
      "(router, correction_bias, expert_w13, expert_w2, tokens_per_expert, step_tokens) "
      "and of `options` (top_k, scoring, renormalize, renormalize_min, "
      "moe_intermediate_size)",
      py::arg("x"), py::arg("weights"), py::arg("options"));
  py::class_<loom::DecoderStack>(m, "DecoderStack",
                                 "a model's decoder layers over one step, in one call")
      .def(py::init<std::vector<DecoderLayerWeights>, std::vector<at::Tensor>,
                    DecoderStackOptions>(),
           py::arg("layers"), py::arg("kv_caches"), py::arg("options"))
      .def("forward", &loom::DecoderStack::forward, py::call_guard<py::gil_scoped_release>(),
           "hidden (T, hidden) -> [hidden, residual] after the last layer",
           py::arg("hidden"), py::arg("positions"), py::arg("cos_sin_cache"),
           py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"),
           py::arg("query_start_loc"))
      .def_property_readonly("num_layers", &loom::DecoderStack::num_layers);
}

}  // namespace

// Every kernel releases the GIL while it runs, as torch's own ops do: a whole layer
// stack can run for seconds on a large model, and the worker's heartbeat thread must
// keep writing meanwhile (pybind converts arguments and results with the GIL held).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &loom::rms_norm, "RMSNorm of each row", release());
  m.def("fused_add_rms_norm", &loom::fused_add_rms_norm, "residual += x; x = rms_norm(residual)",
        release());
  m.def("add_rms_norm", &loom::add_rms_norm, "residual += x; out = rms_norm(residual)",
        release());
  m.def("silu_and_mul", &loom::silu_and_mul, "silu(gate) * up", release());
  m.def("rotary_embedding", &loom::rotary_embedding, "neox rotary, in place", release());
  m.def("write_kv_cache", &loom::write_kv_cache, "copy new K/V into their cache slots", release());
  m.def("paged_attention", &loom::paged_attention, "causal attention over paged K/V", release());
  m.def("paged_attention_windowed", &loom::paged_attention_windowed,
        "causal attention over paged K/V, each query seeing its last sliding_window keys",
        release());
  m.def("bf16_gemm_available", &loom::bf16_gemm_available,
        "whether bf16_linear runs here (AVX512-BF16)");
  m.def("bf16_amx_available", &loom::bf16_amx_available,
        "whether bf16_linear runs many rows on the AMX tiles here");
  m.def("set_bf16_amx", &loom::set_bf16_amx,
        "allow (the default) or forbid the AMX tiles (LOOM_AMX, loom/envs.py)");
  m.def("pack_bf16_weight", &loom::pack_bf16_weight, "a linear weight in bf16_linear's layout",
        release());
  m.def("bf16_gather_rows", &loom::bf16_gather_rows,
        "out = rows ids of the (n, K) weight held as pack_bf16_weight's panels",
        py::arg("out"), py::arg("packed"), py::arg("ids"), py::arg("n"), release());
  m.def("bf16_linear", &loom::bf16_linear, "out = x @ W^T (+ bias), bf16, W packed",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        release());
  m.def(
      "bf16_linear_group",
      [](std::vector<at::Tensor> outs, std::vector<at::Tensor> xs,
         std::vector<at::Tensor> packed) {
        TORCH_CHECK(outs.size() == xs.size() && xs.size() == packed.size(),
                    "bf16_linear_group: as many outs as xs as packed weights");
        std::vector<loom::Bf16Matmul> matmuls;
        for (size_t i = 0; i < outs.size(); ++i)
          matmuls.push_back(loom::bf16_matmul(outs[i], xs[i], packed[i]));
        loom::bf16_linear_group(matmuls);
      },
      "outs[i] = xs[i] @ W_i^T for each i, bf16, in one parallel region (each as bf16_linear)",
      py::arg("outs"), py::arg("xs"), py::arg("packed"), release());
  m.def("moe_route", &loom::moe_route,
        "a mixture of experts' router: x (T, H) bf16 -> [weights (T, K) float32, ids (T, K)]",
        py::arg("x"), py::arg("router"), py::arg("correction_bias"), py::arg("top_k"),
        py::arg("scoring"), py::arg("renormalize"), py::arg("renormalize_min"), release());
  m.def("argmax_rows", &loom::argmax_rows,
        "logits (R, V) float32 -> (R,) int64, each row's first largest (torch.argmax)",
        release());
  bind_quant_gemm(m);
  bind_decoder_stack(m);
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
        "for tests only: make the kernels with two paths (bf16 SiLU*mul and paged "
        "attention) take 'generic' or 'avx512'; returns the previous one",
        py::arg("name"));
}
