"""BERT as an encoder: ``BertModel`` for embeddings (``--task embed``) and
``BertForSequenceClassification`` as a cross-encoder (``--task score``) or classifier
(``--task classify``), tensor parallel, as transformers computes them.

An encoder attends both ways over the whole prompt, so it runs each prompt whole in one
step and keeps no KV cache (``EncoderOnlyModel``; layers/encoder_attention.py). BERT sums
word, token type and absolute position embeddings, then post-norm layers: attention and
the GELU MLP, each followed by LayerNorm(x + sublayer(x)). The classifier reads the
first token ([CLS]) through the pooler (dense, tanh). A pair's token types (0 for
``[CLS] query [SEP]``, 1 for ``document [SEP]``) arrive as ``token_type_ids`` from the
model runner (``PoolingParams.token_type_start``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.kernel_replay import forget_recordings
from loom.model.layers.embedding import VocabParallelEmbedding
from loom.model.layers.encoder_attention import encoder_attention
from loom.model.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear,
                                      default_weight_loader)

# transformers' ACT2FN names of the activations loom's encoders run
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; only "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class EncoderOnlyModel(nn.Module):
    """The model runner's contract for an encoder: no attention layer over the KV cache
    (so no KV cache: the runner allocates none and the engine's blocks cost nothing),
    each prompt whole in one step. ``checkpoint_defaults`` knows the same architectures
    as encoders without torch (``registry.is_encoder_only``)."""

    is_encoder_only = True

    @property
    def attention_layers(self) -> list[nn.Module]:
        return []

    @property
    def num_attention_layers(self) -> int:
        return 0

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       quantized: bool = False) -> tuple[int, ...]:
        return (num_blocks, block_size, 0)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        if kv_caches:
            raise ValueError(f"an encoder holds no KV cache; got {len(kv_caches)} tensors")
        forget_recordings(self)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]],
              rename: Callable[[str], tuple[str, Any] | None]) -> set[str]:
        """Copy checkpoint tensors into this rank's shards: ``rename`` gives each
        checkpoint name's (parameter name, shard id), or None for a tensor this model
        does not use."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            target = rename(name)
            if target is None:
                continue
            name, shard_id = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}; is the architecture right?")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if isinstance(shard_id, tuple):  # a fused checkpoint tensor: its parts
                for part, part_id in zip(loaded_weight.chunk(len(shard_id)), shard_id):
                    weight_loader(param, part, part_id)
            else:
                weight_loader(param, loaded_weight, shard_id)
            loaded.add(name)
        return loaded


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__()
        size = getattr(config, "embedding_size", config.hidden_size)  # ELECTRA's own width
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, size, tp_group)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        self.LayerNorm = nn.LayerNorm(size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            types = self.token_type_embeddings.weight[0]  # every token of type 0
        else:
            types = self.token_type_embeddings(token_type_ids)
        embeddings = self.word_embeddings(input_ids) + types
        embeddings = embeddings + self.position_embeddings(self.position_ids(input_ids,
                                                                             positions))
        return self.LayerNorm(embeddings)

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows of ``position_embeddings`` the tokens read: BERT's, their positions."""
        return positions


class BertSelfOutput(nn.Module):
    """A sublayer's projection back to the hidden size, then LayerNorm(x + it)."""

    def __init__(self, input_size: int, config: Any, tp_group: TPGroup,
                 quantization: str) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True,
                                       tp_group=tp_group, quantization=quantization)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, quantization: str) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads,
                                          num_heads, bias=True, tp_group=tp_group,
                                          quantization=quantization)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.output = BertSelfOutput(config.hidden_size, config, tp_group, quantization)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).view(
            -1, 3, self.num_heads, self.head_dim).unbind(1)  # (T, H, D) each
        attended = encoder_attention(q, k, v, self.head_dim ** -0.5)
        return self.output(attended, hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, quantization: str) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                          bias=True, tp_group=tp_group,
                                          quantization=quantization)
        self.act = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, quantization: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, tp_group, quantization)
        self.intermediate = BertIntermediate(config, tp_group, quantization)
        self.output = BertSelfOutput(config.intermediate_size, config, tp_group, quantization)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden_states)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, tp_group: TPGroup, quantization: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, tp_group, quantization)
                                   for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertPooler(nn.Module):
    """The classifier's input: the first token's final state, dense, tanh (or another
    family's activation)."""

    def __init__(self, config: Any, tp_group: TPGroup, activation_name: str = "tanh") -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True,
                                      tp_group=tp_group)
        self.act = activation(activation_name)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(first_tokens))


def _check_config(config: Any) -> None:
    if getattr(config, "is_decoder", False):
        raise ValueError("this BERT config is a decoder (is_decoder true): loom runs BERT "
                         "as an encoder only")
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"BERT position_embedding_type {kind!r} is not supported; only "
                         "absolute")


def _bert_name(name: str) -> tuple[str, Any] | None:
    """A BERT checkpoint name as this module tree's (q, k and v fused), or None."""
    name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # old checkpoints
    for part, shard_id in (("query", "q"), ("key", "k"), ("value", "v")):
        fused = name.replace(f".attention.self.{part}.", ".attention.qkv_proj.")
        if fused != name:
            return fused, shard_id
    return name, None


class BertModel(EncoderOnlyModel):
    """BERT's encoder: embeddings and layers; its final hidden states are what an
    embedding model pools (loom/pooling.py). Its pooler's weights, if the checkpoint
    has them, are not used (sentence-transformers pools the hidden states)."""

    embeddings_class: type[BertEmbeddings] = BertEmbeddings
    checkpoint_prefix = "bert."  # the base model's names in a checkpoint of a head
    pooler_activation = "tanh"

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE, attention_backend: str = "",
                 weight_quantization: str = "none", expert_parallel: Any = None,
                 with_pooler: bool = False) -> None:
        super().__init__()
        _check_config(config)
        self.config = config
        self.tp_group = tp_group
        self.embeddings = self.embeddings_class(config, tp_group)
        # weight_quantization: what the layers' linears hold (layers/quantization.py)
        self.encoder = BertEncoder(config, tp_group, weight_quantization)
        self.pooler = (BertPooler(config, tp_group, self.pooler_activation) if with_pooler
                       else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``, ``positions`` (T,), each request's tokens contiguous, each
        prompt whole -> final hidden states (T, hidden_size)."""
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the engine's own profiling and warm-up steps sample from (requests to
        an embedding model pool, they never sample): the hidden states."""
        return hidden_states.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> tuple[str, Any] | None:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.split(".", 1)[0] not in self._modules or name.endswith(
                    ("position_ids", "token_type_ids")):
                return None  # heads (pre-training, a classifier, an unused pooler), buffers
            return _bert_name(name)

        return self._load(weights, rename)


class BertForSequenceClassification(EncoderOnlyModel):
    """BERT with its classifier: the pooled first token through ``classifier``
    (num_labels). A cross-encoder when it scores a query-document pair
    (``sequence_logits``; loom/pooling.py)."""

    model_class: type[BertModel] = BertModel
    # checkpoint name prefixes read as others of this module tree (a family whose head
    # is BERT's under other names)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE, attention_backend: str = "",
                 weight_quantization: str = "none", expert_parallel: Any = None) -> None:
        super().__init__()
        self.config = config
        self.bert = self.model_class(config, tp_group, weight_quantization=weight_quantization,
                                     with_pooler=True)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True,
                                           tp_group=tp_group)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids)

    def sequence_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """One whole prompt's final hidden states (L, hidden_size) -> its labels'
        logits (num_labels,) float32."""
        return self.compute_logits(hidden_states[:1])[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, num_labels) float32: each row read as a first token."""
        return self.classifier(self.bert.pooler(hidden_states)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> tuple[str, Any] | None:
            if name.startswith(("cls.", "lm_head.")) or name.endswith(
                    ("position_ids", "token_type_ids")):
                return None
            for old, new in self.checkpoint_renames:
                if name.startswith(old):
                    name = new + name.removeprefix(old)
                    break
            return _bert_name(name)

        return self._load(weights, rename)
