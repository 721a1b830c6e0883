"""ModernBERT as an encoder: ``ModernBertModel`` for embeddings (``--task embed``) and
``ModernBertForSequenceClassification`` as a cross-encoder (``--task score``) or
classifier (``--task classify``), tensor parallel, as transformers computes them.

Pre-norm layers (the first without its attention norm) over token embeddings normed
once; no token types, no position embeddings: rotary on q and k (rotate-half, in
float32), with one base for the global layers and another for the local ones. Layers
alternate: every ``global_attn_every_n_layers``-th (``layer_types``) attends over the
whole prompt, the others over a window of ``local_attention`` tokens, half on each side
(|i - j| <= local_attention // 2). The MLP is a GeGLU (``Wi`` holds input and gate), the
stack ends with a final norm. The classifier pools the final states (the first token,
or the mean: ``classifier_pooling``), then dense, activation, norm, ``classifier``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.embedding import VocabParallelEmbedding
from loom.model.layers.encoder_attention import encoder_attention
from loom.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear)
from loom.model.models.bert import EncoderOnlyModel, activation

_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}


def _layer_norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    every = getattr(config, "global_attn_every_n_layers", 3)
    return ["sliding_attention" if i % every else "full_attention"
            for i in range(config.num_hidden_layers)]


def _rope_theta(config: Any, layer_type: str) -> float:
    """The layer type's rope base (transformers 5's ``rope_parameters`` per layer type,
    or 4's ``global_rope_theta`` / ``local_rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"ModernBERT rope_type {rope_type!r} is not supported; only default")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    old = "global_rope_theta" if layer_type == "full_attention" else "local_rope_theta"
    return float(getattr(config, old, None) or _DEFAULT_THETA[layer_type])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by the positions' cos, sin (T, 1, D), in float32 (rotate-half:
    the first half of each head pairs with the second)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


class ModernBertAttention(nn.Module):
    def __init__(self, config: Any, layer_type: str, tp_group: TPGroup,
                 quantization: str) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // num_heads
        self.Wqkv = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_heads,
                                      bias=config.attention_bias, tp_group=tp_group,
                                      quantization=quantization)
        self.num_heads = self.Wqkv.num_heads  # this rank's
        self.Wo = RowParallelLinear(config.hidden_size, config.hidden_size,
                                    bias=config.attention_bias, tp_group=tp_group,
                                    quantization=quantization)
        self.layer_type = layer_type
        self.window = (config.local_attention // 2 if layer_type == "sliding_attention"
                       else None)

    def forward(self, hidden_states: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.Wqkv(hidden_states).view(
            -1, 3, self.num_heads, self.head_dim).unbind(1)  # (T, H, D) each
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        return self.Wo(encoder_attention(q, k, v, self.head_dim ** -0.5, self.window))


class ModernBertMLP(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, quantization: str) -> None:
        super().__init__()
        size = config.intermediate_size
        self.Wi = MergedColumnParallelLinear(config.hidden_size, [size, size],
                                             bias=config.mlp_bias, tp_group=tp_group,
                                             quantization=quantization)
        self.act = activation(config.hidden_activation)
        self.Wo = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias,
                                    tp_group=tp_group, quantization=quantization)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(hidden_states).chunk(2, dim=-1)  # this rank's halves
        return self.Wo(self.act(value) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, layer_type: str, tp_group: TPGroup,
                 quantization: str) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer_idx == 0 else _layer_norm(config)
        self.attn = ModernBertAttention(config, layer_type, tp_group, quantization)
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config, tp_group, quantization)

    def forward(self, hidden_states: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), rope)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                     tp_group)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(EncoderOnlyModel):
    """ModernBERT's encoder; its final (normed) hidden states are what an embedding
    model pools (loom/pooling.py)."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE, attention_backend: str = "",
                 weight_quantization: str = "none", expert_parallel: Any = None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.embeddings = ModernBertEmbeddings(config, tp_group)
        layer_types = _layer_types(config)
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(config, i, layer_type, tp_group, weight_quantization)
            for i, layer_type in enumerate(layer_types))
        self.final_norm = _layer_norm(config)
        head_dim = config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        for layer_type in sorted(set(layer_types)):  # (D / 2,) float32, as transformers'
            inv_freq = 1.0 / _rope_theta(config, layer_type) ** exponents
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq.to(
                self.final_norm.weight.device), persistent=False)

    def _rope(self, positions: torch.Tensor, layer_type: str,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D) of the positions for the layer type's base."""
        freqs = positions[:, None].float() * getattr(self, f"{layer_type}_inv_freq")
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``, ``positions`` (T,), each request's tokens contiguous, each
        prompt whole -> final hidden states (T, hidden_size). (No token types: a pair's
        are ignored, as transformers' ModernBERT takes none.)"""
        hidden_states = self.embeddings(input_ids)
        ropes = {layer.attn.layer_type: None for layer in self.layers}
        for layer_type in ropes:
            ropes[layer_type] = self._rope(positions, layer_type, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, ropes[layer.attn.layer_type])
        return self.final_norm(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the engine's own profiling and warm-up steps sample from (requests to
        an embedding model pool, they never sample): the hidden states."""
        return hidden_states.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> tuple[str, Any] | None:
            name = name.removeprefix("model.")
            if name.startswith(("head.", "decoder.", "classifier.")):
                return None  # a masked-LM or classifier checkpoint's heads
            return _modernbert_name(name)

        return self._load(weights, rename)


def _modernbert_name(name: str) -> tuple[str, Any]:
    """The parameter a checkpoint name loads and its shard ids (Wqkv's q, k, v thirds,
    Wi's value and gate halves, each loaded as its own shard)."""
    if ".attn.Wqkv." in name:
        return name, ("q", "k", "v")
    if ".mlp.Wi." in name:
        return name, (0, 1)
    return name, None


class ModernBertForSequenceClassification(EncoderOnlyModel):
    """ModernBERT with its classifier: the pooled final states through the head (dense,
    activation, norm) and ``classifier`` (num_labels). A cross-encoder when it scores
    a query-document pair (``sequence_logits``; loom/pooling.py)."""

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE, attention_backend: str = "",
                 weight_quantization: str = "none", expert_parallel: Any = None) -> None:
        super().__init__()
        self.config = config
        pooling = getattr(config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"ModernBERT classifier_pooling {pooling!r} is not supported; "
                             "only cls or mean")
        self.pooling = pooling
        self.model = ModernBertModel(config, tp_group, weight_quantization=weight_quantization)
        self.head = nn.Module()
        self.head.dense = ReplicatedLinear(config.hidden_size, config.hidden_size,
                                           bias=config.classifier_bias, tp_group=tp_group)
        self.head.norm = _layer_norm(config)
        self.head_act = activation(config.classifier_activation)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True,
                                           tp_group=tp_group)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions)

    def sequence_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """One whole prompt's final hidden states (L, hidden_size) -> its labels'
        logits (num_labels,) float32."""
        pooled = (hidden_states[:1] if self.pooling == "cls"
                  else hidden_states.mean(dim=0, keepdim=True))
        return self.compute_logits(pooled)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) pooled states -> (N, num_labels) float32."""
        head = self.head.norm(self.head_act(self.head.dense(hidden_states)))
        return self.classifier(head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> tuple[str, Any] | None:
            if name.startswith("decoder."):
                return None
            return _modernbert_name(name)

        return self._load(weights, rename)
