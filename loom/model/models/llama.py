"""Llama (and Mistral) for causal LM, tensor parallel.

Qwen2 and Qwen3 subclass ``LlamaForCausalLM`` and turn on what differs: a qkv bias
(``attention_biases``) and a per-head RMSNorm on q and k before rope (``qk_norm``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.kernels import native_ops_for
from loom.model.attention.cpu_backend import CpuAttentionBackend
from loom.model.attention.metadata import get_forward_context
from loom.model.layers.activation import SiluAndMul
from loom.model.layers.attention import Attention
from loom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from loom.model.layers.layernorm import RMSNorm
from loom.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear, default_weight_loader)
from loom.model.layers.rotary import RopeStep, RotaryEmbedding, get_rope


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# Children are called through ``.forward`` in the per-token path: ``nn.Module.__call__``
# costs about 1.5 us and a decode step makes some 330 such calls (no hooks are used).


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, tp_group: TPGroup,
                 biases: tuple[bool, bool], qk_norm: bool,
                 rotary_emb: RotaryEmbedding, attention_backend: str) -> None:
        super().__init__()
        qkv_bias, o_bias = biases
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=qkv_bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size,
            bias=o_bias, tp_group=tp_group)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, layer_idx=layer_idx,
                              backend=attention_backend)

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj.forward(hidden_states)  # (T, (H + 2 Hkv) * D): | q | k | v |
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads,
                                                      self.head_dim)  # (T, Hkv, D)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm.forward(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotary_emb.rotate(q, rope), self.rotary_emb.rotate(k, rope)
        else:
            # q and k are adjacent: rotate both heads' sets in one pass
            qk = qkv[:, :self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = self.rotary_emb.rotate(qk, rope)  # (T, H + Hkv, D)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = self.attn.forward(q, k, v)
        return self.o_proj.forward(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, tp_group=tp_group)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=bias, tp_group=tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, tp_group: TPGroup,
                 biases: tuple[bool, bool], qk_norm: bool,
                 rotary_emb: RotaryEmbedding, attention_backend: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp_group, biases, qk_norm,
                                        rotary_emb, attention_backend)
        self.mlp = LlamaMLP(config, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, rope: RopeStep, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm.forward(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward(hidden_states, residual)
        hidden_states = self.self_attn.forward(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm.forward(hidden_states, residual)
        return self.mlp.forward(hidden_states), residual


class NativeLayers(NamedTuple):
    """What ``decoder_layers`` of loom's CPU kernels takes to run every decoder layer in
    one call: the modules' own weights (packed for loom's bf16 matmul), KV caches and
    sizes. The native stack runs the same kernels in the same order as the modules'
    forward, so results are identical; it saves the Python around ~25 small ops per
    layer (SmolLM2 decode step at context 192, benchmarks/profile_step.py: batch 1
    8.9 -> 7.8 ms, batch 32 19.3 -> 17.8 ms). It applies on the CPU in bfloat16 with
    loom's matmul (AVX512-BF16), one rank, the ``cpu`` attention backend, no
    o_proj/down_proj bias; ``LOOM_NATIVE_LAYERS=0`` turns it off."""

    ops: Any
    weights: list[torch.Tensor]
    kv_caches: list[torch.Tensor]
    sizes: tuple[int, int, int, int]  # heads, kv heads, head_dim, intermediate size
    scale: float
    eps: float

    @staticmethod
    def build(model: LlamaModel, hidden_states: torch.Tensor) -> NativeLayers | bool:
        ops = native_ops_for(hidden_states.device, hidden_states.dtype)
        if (ops is None or hidden_states.dtype != torch.bfloat16
                or os.environ.get("LOOM_NATIVE_LAYERS", "1") == "0"
                or not ops.bf16_gemm_available()):
            return False
        weights: list[torch.Tensor] = []
        kv_caches: list[torch.Tensor] = []
        none = torch.empty(0, dtype=hidden_states.dtype)
        first = model.layers[0]
        eps = first.input_layernorm.eps
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm) + (
                (attn.q_norm, attn.k_norm) if attn.qk_norm else ())
            if (not isinstance(attn.attn.impl, CpuAttentionBackend)
                    or attn.attn.kv_cache is None
                    # a row-parallel bias is added after the bf16 rounding (after the
                    # all-reduce); bf16_linear would add it before: not bit for bit
                    or attn.o_proj.bias is not None or mlp.down_proj.bias is not None
                    or any(not lin.tp_group.is_single or lin.packed_weight is None
                           or not lin.packed_weight.is_loom_kernel for lin in linears)
                    or any(norm.eps != eps or norm.weight.dtype != hidden_states.dtype
                           for norm in norms)):
                return False
            kv_caches.append(attn.attn.kv_cache)
            for norm, lins in ((layer.input_layernorm, linears[:2]),
                               (layer.post_attention_layernorm, linears[2:])):
                weights.append(norm.weight)
                for lin in lins:
                    weights += [lin.packed_weight.data,
                                none if lin.bias is None else lin.bias]
            weights += ([attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm
                        else [none, none])
        attn = first.self_attn
        return NativeLayers(ops, weights, kv_caches,
                            (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                             first.mlp.down_proj.input_size),
                            attn.attn.impl.scale, eps)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, biases: tuple[bool, bool],
                 qk_norm: bool, attention_backend: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_group)
        self.rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp_group, biases, qk_norm, self.rotary_emb,
                              attention_backend)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._native_plan: NativeLayers | bool | None = None  # None: not planned yet

    def invalidate_native_layers(self) -> None:
        """Weights re-packed or KV caches re-bound: plan again at the next step."""
        self._native_plan = None

    def process_weights_after_loading(self) -> None:
        self.invalidate_native_layers()

    def _plan_native_layers(self, hidden_states: torch.Tensor) -> NativeLayers | bool:
        """The native layer stack's inputs, or False where it does not apply; kept
        until ``invalidate_native_layers`` (a re-pack, or ``bind_kv_cache``: the memory
        profiler's throwaway cache is replaced before the first real step). Not kept
        while a layer has no KV cache (a forward without one), so a later step plans
        again."""
        plan = NativeLayers.build(self, hidden_states)
        if plan or all(layer.self_attn.attn.kv_cache is not None for layer in self.layers):
            self._native_plan = plan
        return plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        plan = self._native_plan if self._native_plan is not None else self._plan_native_layers(
            hidden_states)
        if plan:  # the whole stack of layers in one native call (see NativeLayers)
            metadata = get_forward_context()
            hidden_states, residual = plan.ops.decoder_layers(
                hidden_states, plan.weights, plan.kv_caches, positions.long(),
                self.rotary_emb.cos_sin_cache, metadata.slot_mapping, metadata.block_table,
                metadata.seq_lens, metadata.query_start_loc, *plan.sizes, plan.scale, plan.eps)
            hidden_states, _ = self.norm.forward(hidden_states, residual)
            return hidden_states
        rope = self.rotary_emb.step_inputs(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer.forward(rope, hidden_states, residual)
        hidden_states, _ = self.norm.forward(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE,
                 attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.model = LlamaModel(config, tp_group, self.attention_biases(config), self.qk_norm,
                                attention_backend)
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

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's cache, as its attention backend lays it out (kv_layout.py)."""
        return self.attention_layers[0].kv_cache_shape(num_blocks, block_size)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV cache tensors for "
                             f"{len(layers)} attention layers")
        for attn, kv_cache in zip(layers, kv_caches):
            attn.kv_cache = kv_cache
        self.model.invalidate_native_layers()

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
    """Mistral without sliding window is Llama."""
