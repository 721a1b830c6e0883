"""Stream tensors from a GGUF file (llama.cpp), dequantized, under Hugging Face names.

llama.cpp's converter permutes the rows of Q and K for the ``llama`` architecture
(interleaved rope pairs instead of halves); ``reverse_permute`` undoes it exactly as
``transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor`` does.

Mixtures of experts (qwen3moe, ernie4_5-moe): the converter stacks each layer's
experts into one 3-d tensor per projection (``blk.N.ffn_gate_exps`` (E, I, H), ...);
they come out here as the per-expert tensors of a Hugging Face checkpoint
(``model.layers.N.mlp.experts.<e>.gate_proj.weight``): dequantized, or with
``keep_quantized`` each expert's rows of the stacked bytes as its own ``QuantizedTensor``
when loom keeps the format (FusedMoE then holds its experts quantized).

A vision projector beside the text file (``--mmproj``) streams after it
(``mmproj_weights_iterator``), under the checkpoint's names (gguf_mmproj.py): Qwen2.5-VL's
``visual.``, Gemma 3's ``vision_tower.vision_model.`` and ``multi_modal_projector.``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loom.model.layers.quantization import QuantizedTensor
from loom.model.loader.gguf_dequant import dequantize
from loom.model.loader.gguf_mmproj import (GEMMA3_PROJECTOR, PATCH_EMBED,
                                          gemma3_tensor_target, mmproj_tensor_target)
from loom.model.loader.gguf_quantized import GGUF_KEPT, gguf_quantized
from loom.model.loader.hf_config import close_gguf_files, open_gguf

logger = logging.getLogger(__name__)

# GGUF per-layer tensor -> Hugging Face module under model.layers.N
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Architectures whose layers name some tensors otherwise (Gemma 3's four norms)
_ARCH_LAYER_NAMES = {
    "gemma3": _LAYER_NAMES | {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_ARCH_LAYER_NAMES["ernie4_5-moe"] = _LAYER_NAMES | {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Whole tensor names (kind included) where Hugging Face's do not end in .weight/.bias
_ARCH_FULL_NAMES = {
    "ernie4_5-moe": {"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"},
}
# Stacked experts (E, out, in) -> each expert's projection
_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# Architectures whose converter stores RMSNorm weights as 1 + w (Hugging Face keeps w)
_NORMS_PLUS_ONE = ("gemma3",)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for
    tensors loom does not use (e.g. ``rope_freqs``). ``architecture``: the file's
    ``general.architecture`` (gemma3 names its norms otherwise)."""
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        names = _ARCH_LAYER_NAMES.get(architecture, _LAYER_NAMES)
        full = _ARCH_FULL_NAMES.get(architecture, {}).get(f"{part}.{kind}")
        if full is not None:
            return f"model.layers.{layer}.{full}"
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
        if part in _EXPERT_PARTS and kind == "weight":  # stacked: split by the iterator
            return f"model.layers.{layer}.mlp.experts.{_EXPERT_PARTS[part]}.weight"
        return None
    if (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def reverse_permute(weights: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (``n_head`` = heads of that tensor);
    numpy arrays or torch tensors."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _permute_rows(weights: torch.Tensor | QuantizedTensor, n_head: int
                  ) -> torch.Tensor | QuantizedTensor:
    if isinstance(weights, QuantizedTensor):
        order = reverse_permute(torch.arange(weights.shape[0]), n_head)
        return weights.rows(order)
    return reverse_permute(weights, n_head)


def _type_name(ggml_type: int) -> str:
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {ggml_type}"


# Decoder linear weights (and token_embd, output): the tensors a GGUF file may keep
# quantized (their loaders take a QuantizedTensor; everything else is dequantized).
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                 "ffn_down")


def gguf_quantized_formats(path: str) -> list[str]:
    """The quantized formats (Q4_K, Q6_K, ...) of ``path``'s 2-d tensors: what
    ``--quantization wint8|wint4`` would round a second time."""
    float_types = {"F32", "F16", "BF16", "F64"}
    kinds = {_type_name(info.ggml_type) for info in open_gguf(path).tensors.values()
             if len(info.shape) >= 2}
    return sorted(kinds - float_types)


def _stacked_quantized(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]
                       ) -> list[QuantizedTensor] | None:
    """A stacked expert tensor's bytes ((E, out, in): each expert's rows one after
    another) as one ``QuantizedTensor`` per expert, or None if loom does not keep the
    format."""
    num_experts, out_features, in_features = shape
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size % num_experts:
        return None
    per_expert = raw.size // num_experts
    experts = []
    for expert in range(num_experts):
        weights = gguf_quantized(raw[expert * per_expert:(expert + 1) * per_expert],
                                 ggml_type, (out_features, in_features))
        if weights is None:
            return None
        experts.append(weights)
    return experts


def gguf_weights_iterator(path: str, hf_config: Any, keep_quantized: bool = False
                          ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield ``(hf_name, tensor)`` one tensor at a time, dequantized to float32 (the
    weight loaders cast to the parameter's dtype as they copy); with ``keep_quantized``,
    decoder linear weights, the embedding and the LM head in a format loom runs
    (``GGUF_KEPT``: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) as ``QuantizedTensor``
    instead, and a log line names the formats that were dequantized."""
    gguf_file = open_gguf(path)
    architecture = gguf_file.metadata.get("general.architecture")
    permute_qk = architecture == "llama"
    num_heads = hf_config.num_attention_heads
    num_kv_heads = hf_config.num_key_value_heads
    dequantized: dict[str, int] = {}
    for info in gguf_file.tensors.values():
        hf_name = gguf_to_hf_name(info.name, architecture)
        if hf_name is None:
            continue
        raw = gguf_file.tensor_bytes(info)
        m = _LAYER_RE.match(info.name)
        linear = (m is not None and m.group(2) in _LINEAR_PARTS and m.group(3) == "weight") \
            or info.name in ("token_embd.weight", "output.weight")
        if keep_quantized and m is not None and m.group(2) in _EXPERT_PARTS:
            experts = _stacked_quantized(raw, info.ggml_type, info.shape)
            if experts is not None:
                prefix, projection = hf_name.rsplit(".experts.", 1)
                for expert, weights in enumerate(experts):
                    yield f"{prefix}.experts.{expert}.{projection}", weights
                gguf_file.release(info)
                continue
            kind = _type_name(info.ggml_type)
            dequantized[kind] = dequantized.get(kind, 0) + 1
        weights = gguf_quantized(raw, info.ggml_type, info.shape) \
            if keep_quantized and linear else None
        if weights is None:
            if keep_quantized and linear:
                kind = _type_name(info.ggml_type)
                dequantized[kind] = dequantized.get(kind, 0) + 1
            try:
                weights = dequantize(raw, info.ggml_type, info.shape)
            except ValueError as error:
                raise ValueError(f"{path}: tensor {info.name}: {error}; convert the file "
                                 f"again with llama.cpp's llama-quantize (e.g. to Q4_K_M "
                                 f"or Q8_0)") from None
        if permute_qk and ".attn_q." in info.name:
            weights = _permute_rows(weights, num_heads)
        elif permute_qk and ".attn_k." in info.name:
            weights = _permute_rows(weights, num_kv_heads)
        elif architecture in _NORMS_PLUS_ONE and hf_name.endswith("norm.weight"):
            weights = weights - 1.0  # back to Hugging Face's w, as transformers does
        if m is not None and m.group(2) in _EXPERT_PARTS:
            prefix, projection = hf_name.rsplit(".experts.", 1)
            for expert in range(weights.shape[0]):  # (E, out, in)
                yield f"{prefix}.experts.{expert}.{projection}", weights[expert]
        else:
            yield hf_name, weights
        # the consumer asked for the next tensor: it has copied this one out of the file
        gguf_file.release(info)
    if dequantized:
        logger.info("GGUF linear weights dequantized (loom keeps %s quantized): %s",
                    ", ".join(GGUF_KEPT.values()),
                    ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items())))
    # Every tensor is in the model now: unmap the file, whose pages read so far would
    # otherwise stay in the resident set (the file's size) as long as the process.
    close_gguf_files()


def gguf_lora_weights(path: str, hf_config: Any, base_architecture: str
                      ) -> dict[str, torch.Tensor]:
    """A llama.cpp LoRA adapter (convert_lora_to_gguf.py; loom/lora.py checked its
    metadata) as PEFT's tensors: each ``<tensor>.lora_a`` (r, in) and ``.lora_b``
    (out, r) under the module ``gguf_to_hf_name`` gives ``<tensor>`` (the base loader's
    map), as ``lora_A.weight`` and ``lora_B.weight``; B scaled by llama.cpp's
    ``alpha / r`` (its own r; 1 where alpha is 0: llama_adapter_lora_weight.get_scale);
    the token embeddings' A, which the converter transposes to (V, r), back to PEFT's
    ``lora_embedding_A`` (r, V); Q's and K's B rows back in the checkpoint's order where
    the converter permuted them (llama), as the base loader does. The adapter's
    architecture must be the base's; a tensor with no place in the base is refused."""
    from loom.lora import AdapterError, check_gguf_adapter_architecture
    from loom.model.loader.gguf_file import GGUFFile

    gguf_file = GGUFFile(path)
    architecture = gguf_file.metadata.get("general.architecture")
    check_gguf_adapter_architecture(path, architecture, base_architecture)
    alpha = float(gguf_file.metadata.get("adapter.lora.alpha", 0.0))
    tensors: dict[str, torch.Tensor] = {}
    for info in gguf_file.tensors.values():
        tensor, _, half = info.name.rpartition(".")
        hf_name = gguf_to_hf_name(tensor, architecture)
        if hf_name is None or not hf_name.endswith(".weight"):
            raise AdapterError(f"LoRA adapter {path!r} holds {info.name}, which loom cannot "
                               f"place on a {architecture} model")
        module = hf_name.removesuffix(".weight")
        try:
            weights = dequantize(gguf_file.tensor_bytes(info), info.ggml_type, info.shape)
        except ValueError as error:
            raise AdapterError(f"LoRA adapter {path!r}: tensor {info.name}: {error}") from None
        if half == "lora_b":
            rank = weights.shape[-1]
            weights = weights * (alpha / rank if alpha else 1.0)
            if architecture == "llama" and tensor.endswith((".attn_q.weight",
                                                            ".attn_k.weight")):
                weights = reverse_permute(weights, hf_config.num_attention_heads
                                          if ".attn_q." in tensor
                                          else hf_config.num_key_value_heads)
        if module == "model.embed_tokens":
            key = "lora_embedding_A" if half == "lora_a" else "lora_embedding_B"
            weights = weights.t().contiguous() if half == "lora_a" else weights
        else:
            key = "lora_A.weight" if half == "lora_a" else "lora_B.weight"
        tensors[f"base_model.model.{module}.{key}"] = weights
    return tensors


def mmproj_weights_iterator(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A llama.cpp vision projector's tensors under the checkpoint's names, dequantized
    to float32 (gguf_mmproj.py). Qwen2.5-VL's: the parts the converter split are joined
    back, the patch embedding's two kernels stacked as its Conv3d's temporal axis, q, k
    and v concatenated into the fused qkv rows. Gemma 3's: one to one."""
    gguf_file = open_gguf(path)
    if gguf_file.metadata.get("clip.projector_type") == GEMMA3_PROJECTOR:
        yield from _gemma3_projector_weights(gguf_file)
        close_gguf_files()
        return
    held: dict[str, dict[int, torch.Tensor]] = {}  # checkpoint name -> its parts so far
    for info in gguf_file.tensors.values():
        hf_name, part, num_parts = mmproj_tensor_target(info.name)
        weights = dequantize(gguf_file.tensor_bytes(info), info.ggml_type, info.shape)
        gguf_file.release(info)
        if num_parts == 1:
            yield hf_name, weights
            continue
        parts = held.setdefault(hf_name, {})
        parts[part] = weights
        if len(parts) == num_parts:
            ordered = [parts[i] for i in range(num_parts)]
            del held[hf_name]
            # (E, C, P, P) x 2 -> (E, C, 2, P, P); rows | q | k | v |
            yield hf_name, (torch.stack(ordered, dim=2) if hf_name == PATCH_EMBED
                            else torch.cat(ordered))
    if held:
        raise ValueError(f"{path} lacks parts of {', '.join(sorted(held))}; convert the "
                         "projector again with llama.cpp's convert_hf_to_gguf.py --mmproj")
    close_gguf_files()


def _gemma3_projector_weights(gguf_file: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A Gemma 3 projector's tensors, one to one, less the offsets the converter added."""
    for info in gguf_file.tensors.values():
        hf_name, offset = gemma3_tensor_target(info.name, info.shape, gguf_file.metadata)
        weights = dequantize(gguf_file.tensor_bytes(info), info.ggml_type, info.shape)
        gguf_file.release(info)
        yield hf_name, (weights - offset if offset else weights)
