"""Llama (and Mistral) for causal LM, tensor parallel.

Each family declares its decoder layer once, as a ``DecoderLayerSpec`` read from the HF
config (``LlamaForCausalLM.layer_spec``): the modules below are built from it. On the
CPU their forward is recorded and replayed natively (``loom/model/kernel_replay.py``),
which needs nothing from the family. Qwen2 and Qwen3 subclass ``LlamaForCausalLM`` and change the spec:
a qkv bias, a per-head RMSNorm on q and k before rope.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.model.layers.activation import GeluTanhAndMul, SiluAndMul
from loom.model.layers.attention import Attention
from loom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from loom.model.layers.fused_moe import FusedMoE, MoESpec
from loom.model.layers.layernorm import RMSNorm, residual_stream
from loom.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear, default_weight_loader)
from loom.model.layers.rotary import RopeStep, RotaryEmbedding, get_rope
from loom.model.kernel_replay import forget_recordings

logger = logging.getLogger(__name__)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class DecoderLayerSpec:
    """What one decoder layer of a Llama-style family is. Sizes are the whole model's;
    each linear layer takes its own rank's share."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # on gate_up and down
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    activation: str = "silu"  # between gate and up: silu or gelu_pytorch_tanh
    # keys a query sees: the last sliding_window positions up to its own (None: all)
    sliding_window: int | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # this layer's rope (rope_type, rope_theta, scaling) where a family sets it per
    # layer (Gemma 3's local base on sliding layers); None: the config's
    rope_parameters: dict[str, Any] | None = field(default=None, hash=False)
    moe: MoESpec | None = None  # a mixture of experts in place of the dense MLP
    # what the qkv, o, gate_up and down weights hold: none (as loaded) or wint8 (int8
    # per output channel, made at load; layers/quantization.py). Not from the HF config:
    # the model's constructor sets it from --quantization.
    weight_quantization: str = "none"

    def __post_init__(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.activation!r} is not supported; only "
                             f"{', '.join(_ACTIVATIONS)}")

    @classmethod
    def from_config(cls, config: Any, **family: Any) -> DecoderLayerSpec:
        """The spec of a Llama config; ``family`` overrides what a family sets itself."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        fields = dict(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config),
            intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
            qkv_bias=attention_bias, o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            activation=getattr(config, "hidden_act", "silu"))
        return cls(**(fields | family))


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


class LlamaAttention(nn.Module):
    def __init__(self, spec: DecoderLayerSpec, layer_idx: int, tp_group: TPGroup,
                 rotary_emb: RotaryEmbedding, attention_backend: str) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads,
                                          spec.num_kv_heads, bias=spec.qkv_bias,
                                          tp_group=tp_group,
                                          quantization=spec.weight_quantization)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size,
                                        bias=spec.o_bias, tp_group=tp_group,
                                        quantization=spec.weight_quantization,
                                        float_output=True)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, eps=spec.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by all layers
        scale = spec.attention_scale if spec.attention_scale is not None \
            else self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=scale, layer_idx=layer_idx, backend=attention_backend,
                              sliding_window=spec.sliding_window)

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2 Hkv) * D): | q | k | v |
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads,
                                                      self.head_dim)  # (T, Hkv, D)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotary_emb.rotate(q, rope), self.rotary_emb.rotate(k, rope)
        else:
            # q and k are adjacent: rotate both heads' sets in one pass
            qk = qkv[:, :self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = self.rotary_emb.rotate(qk, rope)  # (T, H + Hkv, D)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, spec: DecoderLayerSpec, tp_group: TPGroup,
                 intermediate_size: int | None = None, float_output: bool = False) -> None:
        super().__init__()
        intermediate_size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [intermediate_size] * 2, bias=spec.mlp_bias,
            tp_group=tp_group, quantization=spec.weight_quantization)
        self.down_proj = RowParallelLinear(intermediate_size, spec.hidden_size,
                                           bias=spec.mlp_bias, tp_group=tp_group,
                                           quantization=spec.weight_quantization,
                                           float_output=float_output)
        self.act_fn = _ACTIVATIONS[spec.activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: DecoderLayerSpec, layer_idx: int, tp_group: TPGroup,
                 rotary_emb: RotaryEmbedding, attention_backend: str,
                 expert_parallel: EPGroup = NO_EP) -> None:
        super().__init__()
        self.spec = spec
        self.self_attn = LlamaAttention(spec, layer_idx, tp_group, rotary_emb,
                                        attention_backend)
        if spec.moe is None:
            # its output joins the residual stream: float32 (a shared expert's does not)
            self.mlp: nn.Module = LlamaMLP(spec, tp_group, float_output=True)
        else:
            shared = (LlamaMLP(spec, tp_group, spec.moe.shared_intermediate_size)
                      if spec.moe.shared_intermediate_size else None)
            self.mlp = FusedMoE(spec.moe, spec.hidden_size, tp_group, expert_parallel,
                                shared, layer_idx, quantization=spec.weight_quantization)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    @property
    def attention(self) -> Attention:
        return self.self_attn.attn

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = residual_stream(hidden_states)
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def _rope_of(config: Any, spec: DecoderLayerSpec) -> RotaryEmbedding:
    """The rope of a layer: its spec's rope_parameters, else the config's."""
    if spec.rope_parameters is None:
        rope = get_rope(config, spec.head_dim)
    else:
        rope = get_rope(SimpleNamespace(rope_parameters=spec.rope_parameters,
                                        max_position_embeddings=config.max_position_embeddings),
                        spec.head_dim)
    rope.rope_parameters = spec.rope_parameters
    return rope


class LlamaModel(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, spec: DecoderLayerSpec, tp_group: TPGroup,
                 attention_backend: str,
                 layer_specs: list[DecoderLayerSpec] | None = None,
                 expert_parallel: EPGroup = NO_EP) -> None:
        """``layer_specs``: each layer's spec where they differ (a sliding window, a
        mixture of experts on some layers); ``spec`` for all when None."""
        super().__init__()
        self.spec = spec
        self.tp_group = tp_group
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, spec.hidden_size,
                                                   tp_group)
        self.rotary_emb = _rope_of(config, spec)
        layer_specs = layer_specs or [spec] * config.num_hidden_layers
        # ropes of layers that set their own (each distinct one built once)
        self.layer_ropes = nn.ModuleDict()
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(layer_spec, i, tp_group,
                                   self._layer_rope(config, layer_spec),
                                   attention_backend, expert_parallel)
            for i, layer_spec in enumerate(layer_specs))
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def _layer_rope(self, config: Any, layer_spec: DecoderLayerSpec) -> RotaryEmbedding:
        if layer_spec.rope_parameters is None or \
                layer_spec.rope_parameters == self.spec.rope_parameters:
            return self.rotary_emb
        for rope in self.layer_ropes.values():
            if rope.rope_parameters == layer_spec.rope_parameters:
                return rope
        rope = self.layer_ropes[str(len(self.layer_ropes))] = _rope_of(config, layer_spec)
        return rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds``: the step's input embeddings where a multimodal model put an
        image's rows in place of its placeholder tokens' (``input_ids`` unused then)."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.step_inputs(positions, hidden_states.dtype)
        ropes = {id(self.rotary_emb): rope} | {
            id(other): other.step_inputs(positions, hidden_states.dtype)
            for other in self.layer_ropes.values()}
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(ropes[id(layer.self_attn.rotary_emb)],
                                            hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        """This family's decoder layer, read from its HF config."""
        return DecoderLayerSpec.from_config(config)

    @classmethod
    def layer_specs(cls, config: Any, spec: DecoderLayerSpec) -> list[DecoderLayerSpec]:
        """Each layer's spec, where a family's layers differ: ``spec`` for all, with the
        config's ``sliding_window`` on the layers its ``layer_types`` call
        ``sliding_attention`` (Qwen2/Qwen3 with ``use_sliding_window``)."""
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if not layer_types or not window:
            return [spec] * config.num_hidden_layers
        return [replace(spec, sliding_window=window) if layer_type == "sliding_attention"
                else spec for layer_type in layer_types]

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch", weight_quantization: str = "none",
                 expert_parallel: EPGroup = NO_EP) -> None:
        """``weight_quantization``: what the decoder's linear layers hold (none or wint8,
        ``DecoderLayerSpec.weight_quantization``); the embedding and LM head stay in
        the model's dtype. ``expert_parallel``: how MoE layers split their experts
        over the TP ranks (layers/fused_moe.py)."""
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        spec = replace(self.layer_spec(config), weight_quantization=weight_quantization)
        layer_specs = [replace(s, weight_quantization=weight_quantization)
                       for s in self.layer_specs(config, spec)]
        self.model = self.model_cls(config, spec, tp_group, attention_backend, layer_specs,
                                    expert_parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- the model runner's contract -------------------------------------------------

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       quantized: bool = False) -> tuple[int, ...]:
        """One layer's cache, as its attention backend lays it out (kv_layout.py);
        ``quantized``: an int8 or fp8 cache, a scale beside each row."""
        return self.attention_layers[0].kv_cache_shape(num_blocks, block_size, quantized)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV cache tensors for "
                             f"{len(layers)} attention layers")
        for attn, kv_cache in zip(layers, kv_caches):
            attn.kv_cache = kv_cache
        forget_recordings(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``, ``positions`` (T,) -> hidden states (T, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32, full vocab on every rank."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into this rank's shards;
        returns the names of the parameters that were loaded."""
        params = dict(self.named_parameters())
        tied = getattr(self.config, "tie_word_embeddings", False)
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            for ckpt_name, (packed_name, shard_id) in self.packed_modules_mapping.items():
                if f".{ckpt_name}." in name:
                    name = name.replace(f".{ckpt_name}.", f".{packed_name}.")
                    break
            else:
                shard_id = None
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is the architecture right?")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight, shard_id)
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Llama, each layer attending over the last ``sliding_window`` tokens where the
    config sets one."""

    @classmethod
    def layer_spec(cls, config: Any) -> DecoderLayerSpec:
        return DecoderLayerSpec.from_config(
            config, sliding_window=getattr(config, "sliding_window", None) or None)
