"""RoBERTa and XLM-RoBERTa as encoders: ``RobertaModel`` / ``XLMRobertaModel`` for
embeddings (bge-m3, multilingual-e5) and their ``*ForSequenceClassification`` as
cross-encoders (bge-reranker) or classifiers, as transformers computes them.

BERT's model (models/bert.py) with two differences:

- Position ids start past the padding token, as fairseq's ``make_positions``: a token
  reads row ``padding_idx + 1 +`` (the non-pad tokens before it in its prompt), a pad
  token row ``padding_idx``. So ``max_position_embeddings`` counts ``padding_idx + 1``
  rows no prompt reaches (514 for 512 tokens; checkpoint_defaults.py takes them off
  the longest prompt).
- The classifier head (``classifier.dense``, tanh, ``classifier.out_proj``, on the
  first token) is BERT's pooler and classifier under other names, and loads into them.

Token types: usually one (``type_vocab_size`` 1), and the tokenizer makes none for a
pair (``<s> query </s></s> document </s>``). XLM-RoBERTa is this model with another
vocabulary (transformers' XLM-RoBERTa classes are copies of RoBERTa's): the registry
maps its architectures to these classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loom.distributed.parallel_state import TPGroup
from loom.model.attention.metadata import get_forward_context
from loom.model.models.bert import BertEmbeddings, BertForSequenceClassification, BertModel


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: Any, tp_group: TPGroup) -> None:
        super().__init__(config, tp_group)
        self.padding_idx = config.pad_token_id

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """padding_idx 1, prompts [5 6 7 | 8 1 9] -> rows [2 3 4 | 2 1 3]. A request's
        tokens before the step's (none for a prompt, which an encoder runs whole; the
        engine's warm-up decode steps have some) count as non-pad."""
        metadata = get_forward_context()
        first = metadata.cached("request_first_token", lambda: _first_tokens(
            metadata.query_start_loc_cpu, input_ids.device))  # [0 0 0 3 3 3]
        not_pad = (input_ids != self.padding_idx).long()
        counts = not_pad.cumsum(0)  # over the step: [1 2 3 4 4 5]
        # within each request: [1 2 3 1 1 2]
        counts = counts - counts[first] + not_pad[first] + positions[first]
        return counts * not_pad + self.padding_idx


def _first_tokens(query_start_loc: list[int], device: torch.device) -> torch.Tensor:
    """(T,) the step index of each token's request's first token."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    return torch.from_numpy(np.repeat(starts[:-1], np.diff(starts))).to(device)


class RobertaModel(BertModel):
    """RoBERTa's (and XLM-RoBERTa's) encoder; its final hidden states are what an
    embedding model pools (loom/pooling.py)."""

    embeddings_class = RobertaEmbeddings
    checkpoint_prefix = "roberta."


class RobertaForSequenceClassification(BertForSequenceClassification):
    """RoBERTa with its classification head: the first token's final state through
    dense, tanh and ``out_proj`` (held as BERT's pooler and classifier)."""

    model_class = RobertaModel
    checkpoint_renames = (("roberta.", "bert."), ("classifier.dense.", "bert.pooler.dense."),
                          ("classifier.out_proj.", "classifier."))
