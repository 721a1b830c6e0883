"""Pooling models: what ``--task embed`` and ``--task score`` make of a checkpoint.

An engine started with ``--task embed`` answers embedding requests: a prompt is
prefilled and its final hidden states (after the model's last norm) are pooled into one
vector, as sentence-transformers does with the same checkpoint:

- ``LAST``: the last token's (decoder embedding models: Qwen3-Embedding, e5-mistral);
- ``MEAN``: the mean over the prompt's tokens;
- ``CLS``: the first token's;

then L2-normalized where the checkpoint's sentence-transformers modules end in a
``Normalize`` (``modules.json``; the pooling mode from ``1_Pooling/config.json``).
Without those files a decoder model pools its last token, normalized (vLLM's default
for a causal LM run as an embedding model). ``--pooler-config`` overrides any of it.

``--task score`` answers rerank and score requests with a decoder reranker
(Qwen3-Reranker-shaped): the query and document are put in the model's prompt
(``score_template``) and the score is the probability of the yes token against the no
token at the next position, ``softmax([logit_no, logit_yes])[1]``
(``classifier_from_token``, default ``["no", "yes"]``).

Encoder models (BERT, ModernBERT, RoBERTa, ELECTRA: ``BertModel``, ``ModernBertModel``,
``RobertaModel``, ``XLMRobertaModel``, ``ElectraModel``) embed the same way, each prompt
run whole in one step attending both ways (their pooling defaults to ``CLS`` where the
checkpoint has no sentence-transformers files). Their ``*ForSequenceClassification``
checkpoints are cross-encoders under ``--task score``, as sentence-transformers'
``CrossEncoder`` and vLLM's score API run them: the query and document are encoded as a
pair by the tokenizer (``[CLS] query [SEP] document [SEP]``, token types 0 then 1;
RoBERTa's ``<s> query </s></s> document </s>``, no types: ``cross_encoder_pair``), the
classifier head reads the pooled output, and its one logit goes through the checkpoint's
activation (``Sigmoid`` unless its config's ``sentence_transformers.activation_fn`` says
``Identity``: ``score_activation``).

``--task classify`` serves a sequence classifier (``*ForSequenceClassification``: a score
head in place of the LM head; models/classification.py): the last token's final hidden
state through the head, softmax over the labels; ``id2label`` names them.

A request's ``dimensions`` cuts a Matryoshka model's embedding to its first values (then
normalized); the model says it is one with ``is_matryoshka`` or
``matryoshka_dimensions`` in its config.json, or in ``--pooler-config``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

TASKS = ("generate", "embed", "score", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")

# Qwen3-Reranker's prompt: a judgement of the document against the query, answered by
# one token, yes or no, after an empty thinking block.
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
    "\"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model pools (see the module's doc)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka: None, no cut allowed; () any number of dimensions up to the hidden
    # size; else the ones the model was trained for
    matryoshka_dimensions: tuple[int, ...] | None = None
    hidden_size: int = 0
    # score: the tokens whose logits make the score, (no, yes), and the prompt that puts
    # a query and a document before them ({query}, {document}, {instruction})
    classifier_from_token: tuple[str, str] = ("no", "yes")
    score_template: str = QWEN3_RERANKER_TEMPLATE
    instruction: str = DEFAULT_INSTRUCTION
    # score on an encoder classifier (a cross-encoder): the pair through the classifier
    # head, its logit through score_activation (sigmoid or identity), in place of the
    # template and the yes/no tokens
    cross_encoder: bool = False
    score_activation: str = "sigmoid"

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why a request's ``dimensions`` cannot be served, or None."""
        if dimensions is None:
            return None
        if self.matryoshka_dimensions is None:
            return ("this model does not support dimensions (it is not a Matryoshka model; "
                    "leave dimensions out)")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return (f"this model supports dimensions "
                    f"{', '.join(map(str, self.matryoshka_dimensions))}, got {dimensions}")
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be in [1, {self.hidden_size}], got {dimensions}"
        return None


_OVERRIDABLE = {f.name for f in fields(PoolerConfig)} - {"hidden_size", "cross_encoder"}
SCORE_ACTIVATIONS = ("sigmoid", "identity")


def pooler_config(model: str, hf_config: Any, override: dict[str, Any] | None, *,
                  default_pooling: str = "LAST", cross_encoder: bool = False) -> PoolerConfig:
    """The checkpoint's pooling (its sentence-transformers files, its config.json's
    Matryoshka fields; ``default_pooling`` where it has no such files; a cross-encoder's
    activation), then ``override`` (``--pooler-config``) field by field."""
    values: dict[str, Any] = {"hidden_size": int(getattr(hf_config, "hidden_size", 0) or 0),
                              "pooling_type": default_pooling, "cross_encoder": cross_encoder}
    if cross_encoder:
        values["score_activation"] = _cross_encoder_activation(hf_config)
    directory = model if os.path.isdir(model) else None
    if directory is not None:
        values |= _sentence_transformers_pooling(directory)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        values["matryoshka_dimensions"] = tuple(int(d) for d in dims)
    elif getattr(hf_config, "is_matryoshka", False):
        values["matryoshka_dimensions"] = ()
    for name, value in (override or {}).items():
        if name not in _OVERRIDABLE:
            raise ValueError(f"--pooler-config has no field {name!r}; its fields are "
                             f"{', '.join(sorted(_OVERRIDABLE))}")
        if name == "pooling_type":
            value = str(value).upper()
            if value not in POOLING_TYPES:
                raise ValueError(f"--pooler-config pooling_type must be one of "
                                 f"{', '.join(POOLING_TYPES)}, got {value!r}")
        elif name == "matryoshka_dimensions":
            value = () if value is True else None if value in (None, False) else \
                tuple(int(d) for d in value)
        elif name == "classifier_from_token":
            if not (isinstance(value, (list, tuple)) and len(value) == 2
                    and all(isinstance(t, str) for t in value)):
                raise ValueError("--pooler-config classifier_from_token must be two token "
                                 "strings, the no token then the yes token")
            value = tuple(value)
        elif name == "normalize":
            value = bool(value)
        elif name == "score_activation" and value not in SCORE_ACTIVATIONS:
            raise ValueError(f"--pooler-config score_activation must be one of "
                             f"{', '.join(SCORE_ACTIVATIONS)}, got {value!r}")
        values[name] = value
    return PoolerConfig(**values)


def _cross_encoder_activation(hf_config: Any) -> str:
    """What sentence-transformers' CrossEncoder applies to a one-label model's logit: the
    config's ``sentence_transformers.activation_fn`` (or, before its v4,
    ``sbert_ce_default_activation_function``), else Sigmoid."""
    settings = getattr(hf_config, "sentence_transformers", None)
    path = settings.get("activation_fn") if isinstance(settings, dict) else None
    path = path or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if not path:
        return "sigmoid"
    name = str(path).rsplit(".", 1)[-1].lower()
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(f"the checkpoint's cross-encoder activation {path} is not one loom "
                         f"applies ({', '.join(SCORE_ACTIVATIONS)}); pass --pooler-config "
                         '\'{"score_activation": "sigmoid"}\' to choose one')
    return name


def _sentence_transformers_pooling(directory: str) -> dict[str, Any]:
    """Pooling type and normalization from a sentence-transformers checkpoint's
    ``modules.json`` and its Pooling module's ``config.json``; {} where it has none."""
    try:
        with open(os.path.join(directory, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return {}
    values: dict[str, Any] = {"normalize": any(
        str(m.get("type", "")).endswith("Normalize") for m in modules)}
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return values
    try:
        with open(os.path.join(directory, pooling.get("path", ""), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return values
    if config.get("pooling_mode_lasttoken"):
        values["pooling_type"] = "LAST"
    elif config.get("pooling_mode_cls_token"):
        values["pooling_type"] = "CLS"
    elif config.get("pooling_mode_mean_tokens"):
        values["pooling_type"] = "MEAN"
    else:
        raise ValueError(f"{directory}: its sentence-transformers pooling "
                         f"({', '.join(k for k, v in config.items() if v is True)}) is not "
                         f"one loom runs ({', '.join(POOLING_TYPES)}); pass --pooler-config")
    return values


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one query against each document, or pairs one to one."""
    queries = [text_1] if isinstance(text_1, str) else list(text_1)
    documents = [text_2] if isinstance(text_2, str) else list(text_2)
    if not queries or not documents:
        raise ValueError("score needs at least one query (text_1) and one document (text_2)")
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise ValueError(f"score pairs texts one to one: got {len(queries)} queries (text_1) "
                         f"and {len(documents)} documents (text_2); give one query or as "
                         "many as documents")
    return list(zip(queries, documents))


def cross_encoder_pair(tokenizer: Any, query: str, document: str) -> tuple[list[int], int | None]:
    """A cross-encoder's input for one pair, as sentence-transformers' CrossEncoder encodes
    it: the tokenizer's (a Hugging Face one) pair encoding, ``[CLS] query [SEP] document
    [SEP]`` for BERT, and the position where the token types turn from 0 to 1 (None where
    the tokenizer makes none, or makes them all 0)."""
    encoded = tokenizer(query, document)
    token_ids = list(encoded["input_ids"])
    types = encoded.get("token_type_ids")
    if not types or 1 not in types:
        return token_ids, None
    start = list(types).index(1)
    if any(t != 1 for t in types[start:]) or any(t != 0 for t in types[:start]):
        raise ValueError(f"the tokenizer's token types for a pair are {list(types)}; loom "
                         "takes 0s then 1s")
    return token_ids, start


def score_prompt(pooler: PoolerConfig, query: str, document: str) -> str:
    """The reranker's prompt for one pair (``score_template``)."""
    return pooler.score_template.format(query=query, document=document,
                                        instruction=pooler.instruction)
