"""Qwen2 for causal LM: Llama with a bias on the q, k, v projections."""

from __future__ import annotations

from typing import Any

from loom.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False
