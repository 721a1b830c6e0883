"""Gemma 3 GGUF files: llama.cpp's names for the four norms, and its ``1 + w`` norm
weights turned back into Hugging Face's ``w`` (the model adds 1 at load either way).
The real file (Gemma 3 270M) is checked against transformers by
benchmarks/gemma3_gguf.py."""

from __future__ import annotations

from loom.model.loader.gguf_loader import gguf_to_hf_name


def test_gemma3_norm_names():
    assert gguf_to_hf_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma3") == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_ffw_norm.weight", "gemma3") == \
        "model.layers.2.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_norm.weight", "gemma3") == \
        "model.layers.2.input_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_q_norm.weight", "gemma3") == \
        "model.layers.2.self_attn.q_norm.weight"
    # llama keeps its own meaning of ffn_norm
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == \
        "model.layers.2.post_attention_layernorm.weight"
