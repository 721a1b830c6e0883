"""Stream tensors from a GGUF file (llama.cpp), dequantized, under Hugging Face names.

llama.cpp's converter permutes the rows of Q and K for the ``llama`` architecture
(interleaved rope pairs instead of halves); ``reverse_permute`` undoes it exactly as
``transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor`` does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

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
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for
    tensors loom does not use (e.g. ``rope_freqs``)."""
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (``n_head`` = heads of that tensor)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def load_gguf_config(path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path))
    if not getattr(config, "architectures", None):
        from loom.model.models.registry import get_model_architecture

        config.architectures = [get_model_architecture(config)]
    return config


def gguf_weights_iterator(path: str, hf_config: Any,
                          dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one tensor at a time, dequantized to ``dtype``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    permute_qk = architecture == "llama"
    num_heads = hf_config.num_attention_heads
    num_kv_heads = hf_config.num_key_value_heads
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if permute_qk and ".attn_q." in tensor.name:
            weights = reverse_permute(weights, num_heads)
        elif permute_qk and ".attn_k." in tensor.name:
            weights = reverse_permute(weights, num_kv_heads)
        yield hf_name, torch.from_numpy(np.array(weights, copy=True)).to(dtype)
