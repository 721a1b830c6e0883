"""Qwen3 for causal LM: Llama with a per-head RMSNorm on q and k before rope,
``head_dim`` taken from the config, and no qkv bias unless ``attention_bias``."""

from __future__ import annotations

from typing import Any

from loom.model.models.llama import DecoderLayerSpec, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        return DecoderLayerSpec.from_config(config, qk_norm=True)
