"""Hugging Face configs of GGUF files whose architecture ``transformers`` does not read
from GGUF (``ernie4_5``, ``ernie4_5-moe``, ``qwen2vl``) or reads without the keys loom
needs (``qwen3moe``: transformers drops ``expert_feed_forward_length``; ``gemma3``: it
drops ``rope.freq_base_swa``, the rope scaling and the final logit soft cap, and scales
queries by 256 ** -0.5 whatever the head size), built from the
metadata llama.cpp's converter writes (convert_hf_to_gguf.py: ``TextModel``'s keys,
plus each model class's own) and from which tensors the file holds:

    <arch>.block_count, embedding_length, feed_forward_length, context_length,
    attention.head_count(_kv), attention.key_length, attention.layer_norm_rms_epsilon,
    rope.freq_base, expert_count, expert_used_count, expert_feed_forward_length,
    expert_shared_count, leading_dense_block_count, interleave_moe_layer_step

A layer is a mixture of experts where the file has its router (``blk.N.ffn_gate_inp``).
What the metadata does not say is the converter's fixed choice: Qwen3-MoE renormalizes
its top-k weights (llama.cpp's qwen3moe graph does), ERNIE's MoE layers run to the
last layer. A ``qwen2vl`` file is Qwen2.5-VL's (or Qwen2-VL's) language model: alone it
runs as Qwen2, text only (a text token's three M-RoPE positions are equal: plain rope);
with ``--mmproj`` it is the text half of the multimodal config, its
``rope.dimension_sections`` the M-RoPE sections (gguf_mmproj.py).

A ``gemma3`` file is read as llama.cpp reads it (src/models/gemma3.cpp), which is what
the converter's keys mean (a Gemma 3 ``TextModel`` writes no layer pattern and no query
scale)::

    attention.sliding_window = W             sliding layers attend over W tokens; absent
                                             or 0: every layer is global
    attention.sliding_window_pattern = p     every p-th layer global, the others sliding
                                             (absent: 6, as in every Gemma 3); a list of
                                             booleans: each layer's "sliding"
    rope.freq_base, rope.scaling.*           the global layers' rope (linear scaling)
    rope.freq_base_swa                       the sliding layers' rope base; absent: 10,000
    final_logit_softcapping                  absent: none
    query scale                              head_dim ** -0.5, but (hidden / heads) ** -0.5
                                             for the 62-layer 27B: query_pre_attn_scalar
"""

from __future__ import annotations

import os
import re
from typing import Any

from loom.model.loader.gguf_file import GGUFFile

# general.architecture -> (transformers config class, loom architecture)
GGUF_ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "ernie4_5-moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
    "qwen2vl": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
# loom architecture -> the general.architecture llama.cpp's converter writes for it (a
# LoRA adapter's GGUF names its base's: loom/lora.py)
LLAMA_CPP_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
    "Ernie4_5ForCausalLM": "ernie4_5", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe",
    "Gemma3ForCausalLM": "gemma3",
}
# llama.cpp's Gemma 3 constants: the layer pattern and sliding rope base where the file
# names none, and the 27B's layer count, whose queries scale by hidden / heads
_GEMMA3_PATTERN = 6
_GEMMA3_SLIDING_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


def config_from_metadata(gguf_file: GGUFFile) -> Any | None:
    """The config of a file in :data:`GGUF_ARCHITECTURES`, or of a Mixtral (llama.cpp
    writes it as ``llama`` with ``llama.expert_count``), else None."""
    import transformers

    metadata = gguf_file.metadata
    arch = metadata.get("general.architecture")
    mixtral = arch == "llama" and "llama.expert_count" in metadata
    if arch not in GGUF_ARCHITECTURES and not mixtral:
        return None
    config_name, architecture = (("MixtralConfig", "MixtralForCausalLM") if mixtral
                                 else GGUF_ARCHITECTURES[arch])

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    fields: dict[str, Any] = dict(
        hidden_size=hidden, num_hidden_layers=num_layers,
        intermediate_size=int(key("feed_forward_length", 4 * hidden)),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(key("rope.freq_base", 10000.0))},
        vocab_size=int(key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))),
        tie_word_embeddings="output.weight" not in gguf_file.tensors)
    for gguf_key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                            ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if gguf_key in metadata:
            fields[field] = int(metadata[gguf_key])
    moe_layers = sorted(int(m.group(1)) for name in gguf_file.tensors
                        if (m := _ROUTER.match(name)))
    if arch == "qwen3moe":
        fields.update(num_experts=int(key("expert_count")),
                      num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(num_layers) if i not in moe_layers])
    elif mixtral:  # every layer a MoE; feed_forward_length is the experts' size
        fields.update(num_local_experts=int(key("expert_count")),
                      num_experts_per_tok=int(key("expert_used_count")))
        if moe_layers != list(range(num_layers)):
            raise ValueError(f"{gguf_file.path}: a Mixtral file has a router in every layer, "
                             f"this one in {moe_layers}")
    elif arch.startswith("ernie4_5"):
        fields["use_bias"] = "blk.0.attn_q.bias" in gguf_file.tensors
    if arch == "ernie4_5-moe":
        fields.update(moe_num_experts=int(key("expert_count")), moe_k=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      moe_num_shared_experts=int(key("expert_shared_count", 0)),
                      moe_layer_start_index=int(key("leading_dense_block_count", 0)),
                      moe_layer_end_index=num_layers - 1,
                      moe_layer_interval=int(key("interleave_moe_layer_step", 1)))
        expected = [i for i in range(fields["moe_layer_start_index"], num_layers)
                    if (i + 1) % fields["moe_layer_interval"] == 0]
        if moe_layers != expected:
            raise ValueError(f"{gguf_file.path}: MoE layers {moe_layers} are not those its "
                             f"metadata implies ({expected})")
    elif arch == "gemma3":
        fields.update(_gemma3_fields(metadata, fields))
    config = getattr(transformers, config_name)(architectures=[architecture], **fields)
    config._name_or_path = os.path.dirname(gguf_file.path)
    return config


def _gemma3_fields(metadata: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A ``gemma3`` file's layer types, ropes, query scale and soft cap (module docstring)."""
    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"gemma3.{name}", default)

    num_layers = fields["num_hidden_layers"]
    window = int(key("attention.sliding_window", 0))
    pattern = key("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if not window:
        sliding = [False] * num_layers
    elif hasattr(pattern, "__len__"):  # one flag a layer
        sliding = [bool(flag) for flag in pattern]
        if len(sliding) != num_layers:
            raise ValueError(f"a gemma3 file's sliding_window_pattern has {len(sliding)} "
                             f"flags for {num_layers} layers; convert the file again")
    else:  # every pattern-th layer global
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                   for i in range(num_layers)]
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1000000.0))}
    if key("rope.scaling.type", "none") == "linear" and key("rope.scaling.factor"):
        full |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif key("rope.scaling.type", "none") != "none":
        raise ValueError(f"a gemma3 file with {key('rope.scaling.type')} rope scaling; loom "
                         "reads Gemma 3's linear scaling only")
    scalar = (fields["hidden_size"] // fields["num_attention_heads"]
              if num_layers == _GEMMA3_27B_LAYERS else fields["head_dim"])
    return dict(
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        sliding_window=window or None, query_pre_attn_scalar=scalar,
        final_logit_softcapping=(float(key("final_logit_softcapping"))
                                 if key("final_logit_softcapping") else None),
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default",
            "rope_theta": float(key("rope.freq_base_swa", _GEMMA3_SLIDING_ROPE_BASE))}})
