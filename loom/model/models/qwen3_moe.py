"""Qwen3-MoE for causal LM: Qwen3's attention (q/k norm) and, on the layers
``decoder_sparse_step`` and ``mlp_only_layers`` pick, a mixture of experts: softmax
router, top-k, weights renormalized when ``norm_topk_prob``, no shared expert."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from loom.model.layers.fused_moe import MoESpec, load_expert_weights
from loom.model.models.llama import DecoderLayerSpec
from loom.model.models.qwen3 import Qwen3ForCausalLM

EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        moe = MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                      intermediate_size=config.moe_intermediate_size,
                      renormalize=bool(config.norm_topk_prob))
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        return [replace(spec, moe=moe) if i not in dense and (i + 1) % step == 0 else spec
                for i in range(config.num_hidden_layers)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = load_expert_weights(weights, self, loaded,
                                   EXPERT_ROLES)
        return super().load_weights(rest) | loaded
