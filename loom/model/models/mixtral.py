"""Mixtral for causal LM: Mistral (a sliding window where the config sets one) with a
mixture of experts on every layer: softmax router, top-k, weights renormalized. The
checkpoint's ``block_sparse_moe`` is loom's ``mlp``; its experts' ``w1``, ``w3``,
``w2`` are gate, up and down."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from loom.model.layers.fused_moe import MoESpec, load_expert_weights
from loom.model.models.llama import DecoderLayerSpec, MistralForCausalLM

# the checkpoint's names, and a GGUF file's (gguf_loader splits the stacked experts
# under Hugging Face's usual projection names)
EXPERT_ROLES = {"w1": "gate", "w3": "up", "w2": "down",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                      intermediate_size=config.intermediate_size, renormalize=True)
        return [replace(spec, moe=moe)] * config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = load_expert_weights(_renamed(weights), self, loaded,
                                   EXPERT_ROLES)
        return super().load_weights(rest) | loaded
