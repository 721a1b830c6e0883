"""ELECTRA as an encoder: ``ElectraModel`` for embeddings and
``ElectraForSequenceClassification`` as a cross-encoder (the ms-marco-electra shape) or
classifier, as transformers computes them.

BERT's model (models/bert.py) with two differences: the embeddings have their own width
(``embedding_size``, smaller than ``hidden_size`` in the small checkpoints), projected to
the layers' by ``embeddings_project``; and the classifier head (``classifier.dense``,
GELU where BERT's pooler has tanh, ``classifier.out_proj``, on the first token) loads as
BERT's pooler and classifier. Token types as BERT's (a pair's 0 then 1).
"""

from __future__ import annotations

from typing import Any

import torch

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.linear import ReplicatedLinear
from loom.model.models.bert import BertForSequenceClassification, BertModel


class ElectraModel(BertModel):
    """ELECTRA's discriminator encoder; its final hidden states are what an embedding
    model pools (loom/pooling.py)."""

    checkpoint_prefix = "electra."
    pooler_activation = "gelu"  # the classifier head's, on its dense layer

    def __init__(self, config: Any, tp_group: TPGroup = SINGLE, attention_backend: str = "",
                 weight_quantization: str = "none", expert_parallel: Any = None,
                 with_pooler: bool = False) -> None:
        super().__init__(config, tp_group, weight_quantization=weight_quantization,
                         with_pooler=with_pooler)
        self.embeddings_project = (
            ReplicatedLinear(config.embedding_size, config.hidden_size, bias=True,
                             tp_group=tp_group)
            if config.embedding_size != config.hidden_size else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions, token_type_ids)
        if self.embeddings_project is not None:  # (T, embedding_size) -> (T, hidden_size)
            hidden_states = self.embeddings_project(hidden_states)
        return self.encoder(hidden_states)


class ElectraForSequenceClassification(BertForSequenceClassification):
    """ELECTRA with its classification head: the first token's final state through
    dense, GELU and ``out_proj`` (held as BERT's pooler and classifier)."""

    model_class = ElectraModel
    checkpoint_renames = (("electra.", "bert."), ("classifier.dense.", "bert.pooler.dense."),
                          ("classifier.out_proj.", "classifier."))
