"""The pooling routes of ``loom serve`` (loom/entrypoints/openai/serving_pooling.py): an
embedding server through OpenAI's SDK (float and base64, batches, token ids, the same
vectors as LLM.embed), a reranker through /v1/rerank, /v2/rerank and /score with the same
scores as LLM.score, and each wrong request answered 400 in OpenAI's error envelope."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from loom import LLM

TEXTS = ["the cat sat on the mat", "hello world"]
NO_YES = '{"classifier_from_token": ["n", "y"]}'  # single tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def embed_server(tiny_model_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--task", "embed",
                        "--pooler-config", '{"matryoshka_dimensions": [16]}',
                        "--served-model-name", "tiny-embed")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def score_server(tiny_model_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--task", "score",
                        "--pooler-config", NO_YES, "--served-model-name", "tiny-rerank")
    yield server
    server.kill()


def test_embeddings_through_the_openai_sdk(embed_server, tiny_model_dir):
    client = embed_server.openai()
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the SDK asks base64
    assert [d.index for d in floats.data] == [0, 1]
    # (two requests, batched apart: float32 sums in another order)
    np.testing.assert_allclose([d.embedding for d in packed.data],
                               [d.embedding for d in floats.data], atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    with LLM(tiny_model_dir, task="embed", max_model_len=512, enable_warm_up=False) as llm:
        want = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    np.testing.assert_allclose([d.embedding for d in floats.data], want, atol=1e-5)
    ids = client.embeddings.create(model="tiny-embed", input=[[5, 6, 7]],
                                   encoding_format="float", dimensions=16)
    assert len(ids.data[0].embedding) == 16 and ids.usage.prompt_tokens == 3


def test_rerank_and_score(score_server, tiny_model_dir):
    query, documents = "what sat on the mat", ["hello world", "the cat sat on the mat"]
    with LLM(tiny_model_dir, task="score", pooler_config={"classifier_from_token": ["n", "y"]},
             max_model_len=512, enable_warm_up=False) as llm:
        want = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    for path in ("/v1/rerank", "/v2/rerank"):
        answer = httpx.post(score_server.url + path, timeout=60, json={
            "model": "tiny-rerank", "query": query, "documents": documents}).json()
        results = answer["results"]
        assert [r["index"] for r in results] == sorted(range(2), key=lambda i: -want[i])
        assert [r["relevance_score"] for r in results] == pytest.approx(
            sorted(want, reverse=True), abs=1e-5)
        assert results[0]["document"] == {"text": documents[results[0]["index"]]}
        assert answer["usage"]["total_tokens"] > 0
    top = httpx.post(score_server.url + "/v1/rerank", timeout=60, json={
        "query": query, "documents": [{"text": d} for d in documents], "top_n": 1,
        "return_documents": False}).json()["results"]
    assert len(top) == 1 and "document" not in top[0]
    scored = httpx.post(score_server.url + "/score", timeout=60, json={
        "text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 7}, "dimensions"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/rerank", {"query": "a", "documents": ["b"]}, "model"),
])
def test_wrong_requests_to_an_embedding_server(embed_server, path, body, param):
    response = httpx.post(embed_server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_wrong_requests_to_a_reranker(score_server):
    for path, body, param in [("/v1/embeddings", {"input": "hi"}, "model"),
                              ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                              ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
                               "text_2")]:
        response = httpx.post(score_server.url + path, json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        score_server.openai().chat.completions.create(
            model="tiny-rerank", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_classify_route(tmp_path):
    """/classify on a *ForSequenceClassification checkpoint: each input's probabilities
    as LLM.classify gives them, labelled by the checkpoint's id2label."""
    import torch
    from checkpoints import _COMMON
    from loom_server import TINY_SERVER_ARGS, LoomServer
    from tokenizer_fixtures import make_tiny_tokenizer
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(**_COMMON, vocab_size=256, num_labels=2,
                         id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1})
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    make_tiny_tokenizer(str(tmp_path))
    with LLM(str(tmp_path), task="classify", max_model_len=512, enable_warm_up=False) as llm:
        want = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    server = LoomServer(str(tmp_path), *TINY_SERVER_ARGS, "--task", "classify")
    try:
        answer = httpx.post(server.url + "/classify", timeout=60, json={"input": TEXTS}).json()
        np.testing.assert_allclose([d["probs"] for d in answer["data"]], want, atol=1e-5)
        assert [d["label"] for d in answer["data"]] == [
            "yes" if probs[1] > probs[0] else "no" for probs in want]
        assert answer["data"][0]["num_classes"] == 2 and answer["usage"]["prompt_tokens"] > 0
        wrong = httpx.post(server.url + "/v1/embeddings", timeout=60, json={"input": "hi"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    finally:
        server.kill()


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_rerank_on_a_cross_encoder(tmp_path, family):
    """/v1/rerank and /score on a BERT cross-encoder (each pair encoded by the tokenizer
    with its token types) and an XLM-RoBERTa one (bge-reranker's shape, no token types):
    the scores LLM.score gives (tests/e2e/test_encoder_pooling.py holds those equal to
    sentence-transformers' CrossEncoder)."""
    from encoder_fixtures import make_classifier
    from loom_server import LoomServer

    path = make_classifier(str(tmp_path / family), family)
    query, documents = "what is the document about ?", ["hello world", "the cat sat on the mat"]
    with LLM(path, task="score", dtype="float32", enable_warm_up=False) as llm:
        want = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    server = LoomServer(path, "--task", "score", "--dtype", "float32")
    try:
        answer = httpx.post(server.url + "/v1/rerank", timeout=60, json={
            "query": query, "documents": documents}).json()
        assert [r["index"] for r in answer["results"]] == sorted(range(2), key=lambda i: -want[i])
        assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
            sorted(want, reverse=True), abs=1e-6)
        scored = httpx.post(server.url + "/score", timeout=60, json={
            "text_1": query, "text_2": documents}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-6)
        long = httpx.post(server.url + "/v1/rerank", timeout=60, json={
            "query": query, "documents": [" ".join(["word"] * 200)]})
        assert long.status_code == 400 and long.json()["error"]["param"] == "documents"
        assert "max_model_len is 128" in long.json()["error"]["message"]
    finally:
        server.kill()
