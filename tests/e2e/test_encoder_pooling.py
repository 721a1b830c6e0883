"""Encoder models (BERT, ModernBERT, RoBERTa, XLM-RoBERTa, ELECTRA) for the pooling tasks,
on tiny random checkpoints (tests/encoder_fixtures.py), float32: ``LLM.embed`` equals
sentence-transformers (CLS and MEAN pooling; ModernBERT's local layers see a window
shorter than the longest text; RoBERTa's positions past the padding token, a pad token
inside a prompt included; ELECTRA's narrower embeddings projected); a cross-encoder's
``LLM.score`` equals sentence-transformers' CrossEncoder on each pair (BERT's token
types, RoBERTa's none; ELECTRA's GELU head; ModernBERT's first-token and mean classifier
pooling; an Identity activation from the config); ``LLM.classify`` equals transformers;
the engine runs each prompt whole with no prefix cache, refuses a too-long prompt and
settings an encoder cannot run, naming them. The same through ``/v1/rerank``:
tests/entrypoints/test_pooling_serving.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from encoder_fixtures import make_classifier, make_embedding_model

from loom import LLM

# mixed lengths in one batch; the last is longer than ModernBERT's local window (4 a side)
TEXTS = ["the cat sat on the mat", "hello world",
         "what is the document about ? a b c d e f g h i j k l m n o p q r s t"]
ENGINE = dict(dtype="float32", enable_warm_up=False)
QUERY = "what is the document about ?"
DOCUMENTS = ["the cat sat on the mat", "hello world",
             "a dog runs fast and then some more words about the cat"]


@pytest.mark.parametrize("family, pooling", [("bert", "cls"), ("bert", "mean"),
                                             ("modernbert", "cls"), ("modernbert", "mean"),
                                             ("roberta", "cls"), ("roberta", "mean"),
                                             ("xlm-roberta", "cls"), ("xlm-roberta", "mean"),
                                             ("electra", "cls"), ("electra", "mean")])
def test_embeddings_equal_sentence_transformers(tmp_path, family, pooling):
    from sentence_transformers import SentenceTransformer

    path = make_embedding_model(str(tmp_path / family), family, pooling)
    model = SentenceTransformer(path, device="cpu")
    want = torch.stack([model.encode(text, convert_to_tensor=True) for text in TEXTS]).float()
    with LLM(path, task="embed", **ENGINE) as llm:
        config = llm.engine.config
        assert not config.scheduler.enable_chunked_prefill
        assert not config.cache.enable_prefix_caching
        batched = llm.embed(TEXTS, use_tqdm=False)
        alone = llm.embed(TEXTS[2], use_tqdm=False)[0]
    got = torch.tensor([o.outputs.embedding for o in batched])
    assert got.shape == want.shape == (3, 64)
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(torch.tensor(alone.outputs.embedding), got[2], atol=1e-6)


@pytest.mark.parametrize("family, overrides", [
    ("bert", {}),
    ("bert", {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}),
    ("modernbert", {}),
    ("modernbert", {"classifier_pooling": "mean"}),
    ("roberta", {}),
    ("xlm-roberta", {}),
    ("electra", {}),
])
def test_cross_encoder_scores_equal_sentence_transformers(tmp_path, family, overrides):
    """Each pair as the CrossEncoder scores it: the tokenizer's pair encoding (BERT's
    token types), the classifier on the pooled output, the checkpoint's activation."""
    from sentence_transformers import CrossEncoder

    path = make_classifier(str(tmp_path / family), family, **overrides)
    want = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    with LLM(path, task="score", **ENGINE) as llm:
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pairs = llm.score([QUERY, "hello"], ["hello world", "hello world"], use_tqdm=False)
    got = [o.outputs.score for o in scores]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert max(got) - min(got) > 1e-3  # the pairs score apart
    if overrides.get("sentence_transformers"):
        assert not all(0 <= score <= 1 for score in got)  # logits, no sigmoid
    assert pairs[0].outputs.score == pytest.approx(got[1], abs=1e-6)
    assert pairs[1].outputs.score != pytest.approx(got[1], abs=1e-4)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "electra"])
def test_classify_equals_transformers(tmp_path, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_classifier(str(tmp_path / family), family, num_labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LLM(path, task="classify", **ENGINE) as llm:
        got = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    for text, probs in zip(TEXTS, got):
        with torch.no_grad():
            want = torch.softmax(hf(**tokenizer(text, return_tensors="pt")).logits[0], dim=0)
        assert torch.allclose(torch.tensor(probs), want, atol=1e-5)


def test_roberta_positions_start_past_padding(tmp_path):
    """RoBERTa's position ids as transformers makes them, each prompt counted on its own
    in a batch: past pad_token_id, a pad token's own; and max_model_len is 2 short of
    max_position_embeddings (positions 2 to 129 of 130 rows), a longer one refused; a
    pooled prompt may fill max_model_len (128 tokens, positions up to 129)."""
    from transformers import AutoModel

    path = make_embedding_model(str(tmp_path / "roberta"), "roberta", "cls")
    prompts = [[0, 5, 6, 7, 2], [0, 8, 1, 1, 9, 10, 2], [0] + [5, 6, 7, 8] * 31 + [9, 10, 2]]
    hf = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        want = [torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, 0],
                                              dim=0) for ids in prompts]
    with LLM(path, task="embed", **ENGINE) as llm:
        assert llm.engine.config.model.max_model_len == 128
        got = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for output, expected in zip(got, want):
        assert torch.allclose(torch.tensor(output.outputs.embedding), expected, atol=1e-5)
    with pytest.raises(ValueError, match="max_model_len 129 exceeds the model's "
                                         "max_position_embeddings 128"):
        LLM(path, task="embed", max_model_len=129, **ENGINE)


def test_what_an_encoder_refuses(tmp_path):
    """A prompt longer than max_model_len (an encoder runs it whole, in one step) is the
    request's error; a step budget below max_model_len, chunked prefill, generation, and
    a classifier of several labels for score refuse to start, each naming the fix."""
    from loom.input_processor import InvalidInputError

    path = make_embedding_model(str(tmp_path / "bert"), "bert", "cls")
    with LLM(path, task="embed", max_model_len=16, **ENGINE) as llm:
        with pytest.raises(InvalidInputError, match="prompt has \\d+ tokens but max_model_len "
                                                    "is 16"):
            llm.embed(TEXTS[2], use_tqdm=False)
        assert len(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="BertModel is an encoder, which runs each prompt "
                                         "whole in one step.*raise --max-num-batched-tokens"):
        LLM(path, task="embed", max_model_len=64, max_num_batched_tokens=32, **ENGINE)
    with pytest.raises(ValueError, match="drop --enable-chunked-prefill"):
        LLM(path, task="embed", enable_chunked_prefill=True, **ENGINE)
    with pytest.raises(ValueError, match="an encoder: start it with --task embed"):
        LLM(path, **ENGINE)
    classifier = make_classifier(str(tmp_path / "classifier"), "bert", num_labels=2)
    with pytest.raises(ValueError, match="has 2: start it with --task classify"):
        LLM(classifier, task="score", **ENGINE)
    with pytest.raises(ValueError, match="start it with --task score \\(a cross-encoder\\) "
                                         "or classify"):
        LLM(classifier, task="embed", **ENGINE)


def test_an_unknown_cross_encoder_activation_is_named(tmp_path):
    path = make_classifier(str(tmp_path / "bert"), "bert")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["sentence_transformers"] = {"activation_fn": "my_package.Squash"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="activation my_package.Squash is not one loom "
                                         "applies.*score_activation"):
        LLM(path, task="score", **ENGINE)


def test_the_registry_and_the_classes_agree_on_encoders():
    """The engine knows an encoder by its architecture without torch; the ranks by the
    model class's ``is_encoder_only``: the same architectures."""
    from loom.model.models.registry import get_model_class, is_encoder_only

    for architecture in ("BertModel", "BertForSequenceClassification", "ModernBertModel",
                         "ModernBertForSequenceClassification", "RobertaModel",
                         "RobertaForSequenceClassification", "XLMRobertaModel",
                         "XLMRobertaForSequenceClassification", "ElectraModel",
                         "ElectraForSequenceClassification", "LlamaForCausalLM",
                         "Qwen3ForSequenceClassification"):
        assert is_encoder_only(architecture) == getattr(get_model_class(architecture),
                                                        "is_encoder_only", False)
