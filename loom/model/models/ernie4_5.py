"""ERNIE 4.5 (dense) for causal LM: Llama with ``use_bias`` on every projection, tied
embeddings by default, and rope on interleaved pairs of dims (``(0, 1), (2, 3), ...``,
as GPT-J) where Llama rotates halves (``(i, i + D/2)``).

The pairs become halves at load: q_proj's and k_proj's output rows of each head are
reordered evens first, then odds. Attention scores are dot products of q and k over
the same reordering, so they are unchanged, and every kernel (the rotary, the native
stack) runs the neox rope it already has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from loom.model.models.llama import DecoderLayerSpec, LlamaForCausalLM, head_dim_of


def interleaved_to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head of a q or k projection (weight (H*D, in) or bias (H*D,))
    reordered from interleaved rope pairs to neox halves: head_dim 4 -> rows 0, 2, 1, 3."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    heads = weight.reshape(-1, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


def rope_pairs_to_halves(weights: Iterable[tuple[str, torch.Tensor]],
                         head_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            tensor = interleaved_to_halves(tensor, head_dim)
        yield name, tensor


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        bias = bool(getattr(config, "use_bias", False))
        return DecoderLayerSpec.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(rope_pairs_to_halves(weights, head_dim_of(self.config)))

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for checkpoint module ``module`` with its rows in the order
        this model holds that module's rows: q_proj's and k_proj's reordered as at load."""
        ((_, b),) = rope_pairs_to_halves([(f"{module}.weight", b)], head_dim_of(self.config))
        return b
