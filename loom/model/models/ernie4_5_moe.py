"""ERNIE 4.5 MoE for causal LM: ERNIE 4.5's attention (interleaved rope pairs made
halves at load, ernie4_5.py) and, on layers ``moe_layer_start_index ..
moe_layer_end_index`` every ``moe_layer_interval``, a mixture of experts: softmax
router, experts chosen on scores plus ``e_score_correction_bias`` and weighed by the
scores alone, renormalized (sum clamped at ``moe_norm_min``), plus
``moe_num_shared_experts`` shared experts as one MLP of that many times the expert size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from loom.model.layers.fused_moe import MoESpec, load_expert_weights
from loom.model.models.ernie4_5 import Ernie4_5ForCausalLM
from loom.model.models.llama import DecoderLayerSpec

EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".mlp.moe_statics.", ".mlp."), tensor


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        moe = MoESpec(num_experts=config.moe_num_experts, top_k=config.moe_k,
                      intermediate_size=config.moe_intermediate_size, renormalize=True,
                      renormalize_min=config.moe_norm_min, correction_bias=True,
                      shared_intermediate_size=(config.moe_intermediate_size
                                                * config.moe_num_shared_experts))
        interval = config.moe_layer_interval
        return [replace(spec, moe=moe)
                if (i + 1) % interval == 0 and config.moe_layer_start_index <= i
                <= config.moe_layer_end_index else spec
                for i in range(config.num_hidden_layers)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = load_expert_weights(_renamed(weights), self, loaded,
                                   EXPERT_ROLES)
        return super().load_weights(rest) | loaded
