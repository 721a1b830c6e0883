"""The native decoder stack: every decoder layer of a step in one call of loom's CPU
kernels (``loom/kernels/csrc/decoder_stack.{h,cpp}``), driven by the model's own
declaration, by name.

A family declares each layer once, in Python, next to its modules: its
``DecoderLayerSpec`` (sizes, biases, norms, activation), from which the modules are
built, and ``weights_by_role()``, which names the module behind each role. The roles
are the fields of the C++ ``DecoderLayerWeights``: a norm's role takes its weight, a
linear layer's role takes its weight as a ``LinearWeight`` (bf16 panels, a quantized
weight, layers/quantization.py, or one per format of a fused layer whose projections
come in several) and ``<role>_bias`` its bias. Nothing is
passed by position. The stack runs the same kernels, on the same tensors, in the same
order as the modules' forward with the ``cpu`` attention backend, so the results are
identical (tests/model/test_models.py compares the two paths bit for bit). It saves the
Python around ~25 small ops per layer (SmolLM2 decode step at context 192,
benchmarks/profile_step.py: batch 1 8.9 -> 7.8 ms, batch 32 19.3 -> 17.8 ms).

``plan_native_stack`` returns the stack, or the reason it does not apply, which the
model logs once at start-up: it runs on the CPU in bfloat16, one rank, the ``cpu``
attention backend, with every decoder weight in a form loom's kernels multiply (bf16
panels, which need AVX512-BF16; quantized, which needs AVX512-BF16 with AVX512BW or
AVX2 with FMA and F16C); ``LOOM_NATIVE_LAYERS=0`` turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from loom.envs import settings
from loom.kernels import native_ops_for
from loom.model.attention.cpu_backend import CpuAttentionBackend
from loom.model.attention.metadata import AttentionMetadata
from loom.model.layers.attention import Attention
from loom.model.layers.fused_moe import FusedMoE
from loom.model.layers.layernorm import RMSNorm
from loom.model.layers.linear import LinearBase


class NativeDecoderLayer(Protocol):
    """What a decoder layer module offers the native stack."""

    attention: Attention
    spec: Any  # its DecoderLayerSpec (models/llama.py): sizes, norms, activation, window

    def weights_by_role(self) -> dict[str, nn.Module | None]:
        """Role (a field of ``DecoderLayerWeights``) -> the RMSNorm or linear layer that
        fills it, None where this layer has none (an optional role)."""
        ...


class NativeDecoderStack:
    """A model's decoder layers bound to their weights and KV caches; ``forward`` runs one
    step. Built by ``plan_native_stack``; rebuilt when weights are re-packed or caches
    re-bound (the model invalidates its plan)."""

    def __init__(self, stack: Any, num_layers: int,
                 moe_layers: Sequence[FusedMoE] = ()) -> None:
        self._stack = stack
        self.num_layers = num_layers
        self._moe_layers = tuple(moe_layers)  # counted a forward each step (their log)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> (hidden, residual) after the last layer, for the final norm."""
        hidden_states, residual = self._stack.forward(
            hidden_states, positions.long(), cos_sin_cache, metadata.slot_mapping,
            metadata.block_table, metadata.seq_lens, metadata.query_start_loc)
        for moe in self._moe_layers:
            moe.count_forward()
        return hidden_states, residual


def plan_native_stack(layers: Sequence[NativeDecoderLayer], device: torch.device,
                      dtype: torch.dtype, num_ranks: int) -> NativeDecoderStack | str | None:
    """The native stack over ``layers``, or why it does not apply (a sentence), or None
    while a layer has no KV cache yet (the memory profiler's forward: plan again later).
    The one place that decides: every refusal is said here."""
    refusal = next((f"layer {index}: {reason}" for index, layer in enumerate(layers)
                    if (reason := _layer_refusal(layer.spec))), None)
    if refusal:
        return refusal
    if device.type != "cpu":
        return f"the stack runs on the CPU and this model runs on {device.type}"
    ops = native_ops_for(device, dtype)
    if ops is None:
        return ("loom's native kernels are not loaded (LOOM_NATIVE_KERNELS=0, no C++ "
                "compiler, or a failed build)")
    if dtype != torch.bfloat16:
        return f"the stack runs bfloat16 and this model runs {str(dtype).removeprefix('torch.')}"
    if not settings().native_layers:
        return "LOOM_NATIVE_LAYERS=0"
    if not ops.bf16_gemm_available() and not ops.quant_gemm_available():
        return "this CPU has neither AVX512-BF16 nor AVX2 with FMA for loom's matmuls"
    if num_ranks != 1:
        return f"tensor parallel over {num_ranks} ranks; the stack runs one rank"
    if any(layer.attention.kv_cache is None for layer in layers):
        return None
    hybrid = next((index for index, layer in enumerate(layers)
                   if layer.attention.kv_cache_group), None)
    if hybrid is not None:
        return (f"layer {hybrid} reads KV cache group {layers[hybrid].attention.kv_cache_group}'s "
                "block tables (a hybrid KV cache); the stack takes one block table")
    moe = next((layer.spec.moe for layer in layers if layer.spec.moe), None)
    if moe is not None and any(layer.spec.moe not in (None, moe) for layer in layers):
        return "its MoE layers differ (the stack has one MoE spec)"
    options = _stack_options(layers, moe)
    fields = set(ops.DecoderLayerWeights.fields)
    stack_layers, kv_caches, moe_layers = [], [], []
    for index, layer in enumerate(layers):
        if not isinstance(layer.attention.impl, CpuAttentionBackend):
            return (f"layer {index} has the {layer.attention.impl.name!r} attention backend; "
                    "the stack runs the 'cpu' kernels")
        weights = ops.DecoderLayerWeights()
        for role, module in layer.weights_by_role().items():
            if isinstance(module, FusedMoE):
                refusal = _fill_experts(ops, weights, fields, role, module)
                moe_layers.append(module)
            else:
                refusal = _fill_role(ops, weights, fields, role, module,
                                     options["rms_norm_eps"], dtype)
            if refusal:
                return f"layer {index}: {refusal}"
        missing = [name for name in ops.DecoderLayerWeights.required
                   if getattr(weights, name) is None]
        if missing:
            return f"layer {index} declares no {', '.join(missing)}"
        stack_layers.append(weights)
        kv_caches.append(layer.attention.kv_cache)
    stack_options = ops.DecoderStackOptions()
    unknown = set(options) - set(ops.DecoderStackOptions.fields)
    if unknown:
        return f"the kernels have no option {', '.join(sorted(unknown))}"
    for name, value in options.items():
        setattr(stack_options, name, value)
    return NativeDecoderStack(ops.DecoderStack(stack_layers, kv_caches, stack_options),
                              len(stack_layers), moe_layers)


def _layer_refusal(spec: Any) -> str | None:
    """Why the stack cannot run a layer of this ``DecoderLayerSpec``, or None."""
    if spec.sliding_window is not None:
        return f"it attends over a sliding window of {spec.sliding_window} tokens"
    if spec.activation != "silu":
        return f"its activation is {spec.activation}"
    return None


def _stack_options(layers: Sequence[NativeDecoderLayer], moe: Any) -> dict[str, Any]:
    """``DecoderStackOptions`` by name, from the layers' declaration (one rank: the whole
    model's sizes; a MoE model's layers share one ``MoESpec``)."""
    attn, spec = layers[0].attention, layers[0].spec
    options = dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                   head_dim=attn.head_dim, intermediate_size=spec.intermediate_size,
                   attention_scale=attn.impl.scale, rms_norm_eps=spec.rms_norm_eps,
                   activation=spec.activation)
    if moe is not None:
        options |= dict(num_experts=moe.num_experts, top_k=moe.top_k,
                        moe_intermediate_size=moe.intermediate_size,
                        shared_intermediate_size=moe.shared_intermediate_size,
                        scoring=moe.scoring, renormalize=moe.renormalize,
                        renormalize_min=moe.renormalize_min)
    return options


def _fill_experts(ops: Any, weights: Any, fields: set[str], role: str,
                  moe: FusedMoE) -> str | None:
    """Set the MoE fields of ``weights`` from ``moe`` (the ``experts`` role): the kernel's
    view of its routed experts (``FusedMoE.native_experts``: router, correction bias,
    each expert's w13 and w2, its load counters), or why it cannot be. The shared
    experts are the ``shared_gate_up``/``shared_down`` roles."""
    if role != "experts" or "expert_w13" not in fields:
        return f"the kernels have no MoE role {role!r} (a stale kernel build?)"
    native = moe.native_experts(ops)
    if isinstance(native, str):
        return native
    experts = native[0]
    for name in ("expert_w13", "expert_w2", "router", "correction_bias", "tokens_per_expert",
                 "step_tokens"):
        setattr(weights, name, getattr(experts, name))
    return None


def _fill_role(ops: Any, weights: Any, fields: set[str], role: str, module: nn.Module | None,
               eps: float, dtype: torch.dtype) -> str | None:
    """Set ``role`` (and ``<role>_bias``) of ``weights`` from ``module``; the reason it
    cannot be, or None."""
    if role not in fields:
        return f"the kernels have no role {role!r} (a stale kernel build?)"
    if module is None:
        return None
    if isinstance(module, RMSNorm):
        if module.eps != eps or module.weight.dtype != dtype:
            return f"{role} has eps {module.eps} or dtype {module.weight.dtype}, not the stack's"
        setattr(weights, role, module.weight)
        return None
    if isinstance(module, LinearBase):
        handle = module.form.native_handle(ops)
        if isinstance(handle, str):
            return f"the {role} {handle}"
        setattr(weights, role, handle)
        if module.bias is not None:
            if f"{role}_bias" not in fields:
                return f"{role} has a bias and the kernels have no {role}_bias"
            setattr(weights, f"{role}_bias", module.bias)
        return None
    return f"{role} is a {type(module).__name__}, which the stack does not run"
