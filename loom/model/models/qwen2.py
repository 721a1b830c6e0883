"""Qwen2 for causal LM: Llama with a bias on the q, k, v projections (none on o)."""

from __future__ import annotations

from typing import Any

from loom.model.models.llama import DecoderLayerSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        return DecoderLayerSpec.from_config(config, qkv_bias=True, o_bias=False)
