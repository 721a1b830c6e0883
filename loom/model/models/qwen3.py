"""Qwen3 for causal LM: Llama with a per-head RMSNorm on q and k before rope,
``head_dim`` taken from the config, and no qkv bias unless ``attention_bias``."""

from __future__ import annotations

from loom.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
