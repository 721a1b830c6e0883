"""Build a model for one TP rank and stream its weights in."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup, expert_parallel_group
from loom.kernels import native_ops
from loom.model.attention import select_attn_backend
from loom.model.layers.embedding import VocabParallelEmbedding
from loom.model.layers.linear import LinearBase
from loom.model.layers.rotary import RotaryEmbedding
from loom.model.layers.weight_forms import MixedFormats, OneDnnWeight
from loom.model.layers.quantization import linear_weight_quantization, table_quantization
from loom.model.loader.gguf_loader import (gguf_quantized_formats, gguf_weights_iterator,
                                           mmproj_weights_iterator)
from loom.model.loader.hf_config import is_gguf, load_hf_config
from loom.model.kernel_replay import install as install_kernel_replay
from loom.model.loader.hf_config_values import HFConfigView
from loom.model.loader.safetensors_loader import safetensors_weights_iterator
from loom.model.models.registry import get_model_architecture, get_model_class

if TYPE_CHECKING:
    from loom.config import ModelConfig, SpeculativeConfig

logger = logging.getLogger(__name__)


def model_hf_config(model_config: ModelConfig | SpeculativeConfig) -> Any:
    """The model's (or the draft's) HF config as ``resolve_against_checkpoint`` read it, from
    its plain values (no ``transformers`` import in this process); read from the
    checkpoint when the config was built without them."""
    if model_config.hf_config is None:
        return load_hf_config(model_config.model, getattr(model_config, "mmproj", None))
    return HFConfigView.from_values(model_config.hf_config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_path: str, hf_config: Any, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", tp_group: TPGroup = SINGLE,
               attention_backend: str = "auto", quantization: str = "auto",
               quantization_group_size: int = 128, lm_head_fp32: bool = False,
               expert_parallel_size: int = 1, max_model_len: int | None = None,
               replicas_group: TPGroup | None = None,
               num_redundant_experts: int = 0) -> nn.Module:
    """Build ``hf_config``'s architecture with this rank's shards on ``device`` in
    ``dtype`` and ``attention_backend`` (a registered name or auto), load every
    parameter from ``model_path``, quantize the decoder's linear weights if
    ``quantization`` says so (layers/quantization.py; ``quantization_group_size`` for
    wint4; ``lm_head_fp32``: float32 logits from a float32 copy of the LM head), return
    it in eval mode. Rank 0 logs the resident weight bytes by dtype. ``expert_parallel_size`` 1 or the TP size:
    MoE layers split their experts whole over the TP ranks (layers/fused_moe.py); or, with
    ``replicas_group`` (every data-parallel replica's ranks) of that size, over all of them;
    ``num_redundant_experts``: EPLB's extra expert slots.
    ``max_model_len``: the ropes' cos/sin caches cover it where it exceeds the config's
    max_position_embeddings (rope scaling)."""
    model_cls = get_model_class(get_model_architecture(hf_config))
    if torch.device(device).type == "cpu":
        native_ops()  # build (or load) the CPU kernels now, not inside the first step
    attention_backend = select_attn_backend(attention_backend, device, dtype)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config, tp_group, attention_backend=attention_backend,
                          weight_quantization=linear_weight_quantization(quantization,
                                                                         quantization_group_size),
                          expert_parallel=expert_parallel_group(tp_group,
                                                                expert_parallel_size,
                                                                replicas_group,
                                                                num_redundant_experts))
    if max_model_len is not None:
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cover(max_model_len)
    if lm_head_fp32 and hasattr(model, "lm_head"):
        model.lm_head.float32 = True
    tables = table_quantization(quantization, lm_head_fp32)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.table_quantization = tables
    if is_gguf(model_path):
        rounded = (gguf_quantized_formats(model_path)
                   if quantization in ("wint8", "wint4") and tp_group.rank == 0 else [])
        if rounded:
            logger.warning("--quantization %s dequantizes this file's %s weights and "
                           "quantizes them again, rounding them twice; --quantization auto "
                           "runs the file's own formats", quantization, "/".join(rounded))
        weights = gguf_weights_iterator(model_path, hf_config,
                                        keep_quantized=quantization == "auto")
        mmproj = getattr(hf_config, "mmproj", None)
        if mmproj is not None:  # the vision tower, from its llama.cpp projector file
            weights = itertools.chain(weights, mmproj_weights_iterator(mmproj))
    else:
        weights = safetensors_weights_iterator(model_path)
    with torch.no_grad():
        loaded = model.load_weights(weights)
    # what a layer makes of its loaded weight (a quantized linear laid out as its last
    # shard arrives: the PyTorch path's scales) is not loaded by name
    derived = {f"{name}.{param}" for name, module in model.named_modules()
               for param in getattr(module, "derived_parameters", ())}
    missing = sorted(set(dict(model.named_parameters())) - loaded - derived)
    if missing:
        raise ValueError(f"{model_path} lacks weights for {len(missing)} parameters, e.g. "
                         f"{missing[:5]}; the checkpoint does not match its config")
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    if tp_group.rank == 0:
        logger.info("weights%s: %s", " per rank" if tp_group.world_size > 1 else "",
                    describe_weight_bytes(weight_bytes_by_dtype(model)))
        reference = sum(isinstance(module, LinearBase) and module.on_reference_path
                        for module in model.modules())
        if reference:
            if torch.device(device).type != "cpu":
                why = f"on {torch.device(device).type}"
            elif dtype != torch.bfloat16:
                why = f"in {str(dtype).removeprefix('torch.')}"
            elif native_ops() is None:
                why = "without loom's CPU kernels (they did not build)"
            else:
                why = "without AVX512-BF16 or AVX2 (with FMA and F16C) on this CPU"
            logger.warning("%d quantized linear layers run the PyTorch reference path %s "
                           "(each matmul dequantizes its weight: correct, not fast); "
                           "loom's kernels take bfloat16 models on CPUs with AVX512-BF16 "
                           "or AVX2",
                           reference, why)
        ops = native_ops() if torch.device(device).type == "cpu" else None
        plain = sum(isinstance(module, LinearBase) and module.weight_format is None
                    for module in model.modules())
        if (plain and dtype == torch.bfloat16 and ops is not None
                and not ops.bf16_gemm_available() and ops.quant_gemm_available()):
            logger.warning("%d bfloat16 linear layers run PyTorch's matmul: this CPU has no "
                           "AVX512-BF16 for loom's bf16 kernel; --quantization wint8 (or "
                           "wint4; a GGUF file's own formats: auto) runs them on loom's "
                           "AVX2 kernel, several times faster",
                           plain)
        mixed_layers = [module for module in model.modules()
                        if isinstance(module, LinearBase) and isinstance(module.form, MixedFormats)]
        if mixed_layers:  # a GGUF file's fused projections in several formats
            mixed = sorted({module.weight_format for module in mixed_layers})
            layers = len(mixed_layers)
            logger.info("%d fused linear layers hold their projections in their own "
                        "formats (%s)", layers, ", ".join(mixed))
    model.eval()
    # on the CPU, one rank: its forward recorded and replayed natively (not when its MoE
    # layers exchange tokens with other replicas: collectives a recording would not see)
    install_kernel_replay(model, max(tp_group.world_size, expert_parallel_size))
    return model


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter (a tied one once) by dtype name, and under ``packed``
    oneDNN's blocked copies (``OneDnnWeight``), which also stay resident."""
    totals: dict[str, int] = {}
    for param in model.parameters():
        name = str(param.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + param.numel() * param.element_size()
    forms = []  # each form once (a tied LM head shares its embedding's)
    for module in model.modules():
        copy = getattr(module, "float32_weight", None)  # --lm-head-fp32
        if copy is not None:
            totals["float32"] = totals.get("float32", 0) + copy.numel() * 4
        form = getattr(module, "form", None)  # a linear layer's, a table's
        if isinstance(form, OneDnnWeight) and all(form is not seen for seen in forms):
            forms.append(form)
        for pair in getattr(module, "expert_forms", None) or ():  # a MoE layer's experts
            forms += [form for form in pair if isinstance(form, OneDnnWeight)]
    for form in forms:  # oneDNN's blocked copies, beside the plain weights
        if form.packed is not None:
            data = form.packed.data
            totals["packed"] = totals.get("packed", 0) + data.numel() * data.element_size()
    return totals


def describe_weight_bytes(totals: dict[str, int]) -> str:
    """``{"int8": 43.2e6, "bfloat16": 18.9e6}`` -> "41.2 MiB int8 + 18.0 MiB bfloat16"."""
    parts = [f"{size / 2**20:.1f} MiB {name}" for name, size in
             sorted(totals.items(), key=lambda item: -item[1]) if name != "packed"]
    text = " + ".join(parts)
    if "packed" in totals:
        text += f" (+ {totals['packed'] / 2**20:.1f} MiB packed copies for the CPU matmul)"
    return text
