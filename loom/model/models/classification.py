"""Sequence classifiers (``*ForSequenceClassification``): a decoder family's model with a
``score`` head (num_labels, hidden) in place of the LM head, served with ``--task
classify`` (loom/pooling.py): the prompt's last token's final hidden state through the
head (``compute_logits``: the labels' logits), softmax over the labels, as transformers
computes it for an unpadded prompt.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.model.layers.linear import ReplicatedLinear
from loom.model.models.llama import LlamaForCausalLM
from loom.model.models.qwen2 import Qwen2ForCausalLM
from loom.model.models.qwen3 import Qwen3ForCausalLM


def _classifier(causal: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    class SequenceClassifier(causal):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            del self.lm_head  # the checkpoint has a score head in its place
            self.score = ReplicatedLinear(config.hidden_size, config.num_labels, bias=False,
                                          tp_group=self.tp_group)

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """(N, hidden_size) -> (N, num_labels) float32: the labels' logits (what the
            engine's own profiling and warm-up steps sample from; requests classify)."""
            return self.score(hidden_states).float()

    name = causal.__name__.replace("ForCausalLM", "ForSequenceClassification")
    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = name
    return SequenceClassifier


LlamaForSequenceClassification = _classifier(LlamaForCausalLM)
Qwen2ForSequenceClassification = _classifier(Qwen2ForCausalLM)
Qwen3ForSequenceClassification = _classifier(Qwen3ForCausalLM)
