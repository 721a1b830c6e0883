"""Pooling models offline (loom/pooling.py): ``LLM.embed`` equals sentence-transformers on
the same checkpoint for each pooling type, through chunked prefill and batching;
``dimensions`` cuts a Matryoshka model's embedding; ``LLM.score`` equals the reranker's
own yes probability computed by transformers; a pooling engine refuses generation
and a generating one refuses pooling, naming the task."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_tiny_checkpoint
from encoder_fixtures import write_sentence_transformers
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.input_processor import InvalidInputError
from loom.sampling_params import PoolingParams

TEXTS = ["the cat sat on the mat", "hello world",
         # longer than a step's token budget below: pooled over two chunks
         "a b c d e f g h i j k l m n o p q r s t u v w x y z and then some more words"]
ENGINE = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              enable_warm_up=False)



@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return make_tiny_tokenizer(path)


def st_embeddings(path: str, texts: list[str], normalize: bool = True) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    # one text a batch: a causal model's last-token pooling under padding is not the point
    return model.encode(texts, batch_size=1, convert_to_tensor=True,
                        normalize_embeddings=normalize).float()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_sentence_transformers(qwen3, tmp_path, pooling):
    # the same checkpoint with its own sentence-transformers files
    path = _copy_with_st(qwen3, tmp_path / pooling, pooling)
    want = st_embeddings(path, TEXTS)
    with LLM(path, task="embed", **ENGINE) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        alone = llm.embed(TEXTS[2], use_tqdm=False)[0]
    got = torch.tensor([o.outputs.embedding for o in outputs])
    assert got.shape == want.shape == (3, 64)
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)
    # batched or alone (other chunk boundaries: float32 sums in another order)
    assert torch.allclose(torch.tensor(alone.outputs.embedding), got[2], atol=1e-6)
    assert len(outputs[2].prompt_token_ids) > ENGINE["max_num_batched_tokens"]  # two chunks


def _copy_with_st(source: str, target, pooling: str, normalize: bool = True) -> str:
    import shutil

    shutil.copytree(source, target)
    return write_sentence_transformers(str(target), pooling, normalize, hidden_size=64)


def test_dimensions_cut_a_matryoshka_embedding(qwen3, tmp_path):
    """``dimensions`` keeps the first values, normalized after the cut if asked; a size
    the model was not trained for, or a model that is not Matryoshka, is the request's
    error. (The checkpoint's sentence-transformers modules end without a Normalize: its
    embeddings are not normalized unless a request asks.)"""
    path = _copy_with_st(qwen3, tmp_path / "mean", "mean", normalize=False)
    full = st_embeddings(path, TEXTS[:2], normalize=False)
    with LLM(path, task="embed", pooler_config={"matryoshka_dimensions": [16, 32]},
             **ENGINE) as llm:
        cut = llm.embed(TEXTS[:2], PoolingParams(dimensions=16, normalize=True),
                        use_tqdm=False)
        raw = llm.embed(TEXTS[:2], use_tqdm=False)
        with pytest.raises(InvalidInputError, match="supports dimensions 16, 32, got 24"):
            llm.embed(TEXTS[:1], PoolingParams(dimensions=24), use_tqdm=False)
    want = torch.nn.functional.normalize(full[:, :16], dim=1)
    got = torch.tensor([o.outputs.embedding for o in cut])
    assert got.shape == (2, 16)
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999
    assert torch.allclose(torch.tensor([o.outputs.embedding for o in raw]), full, atol=1e-4)
    with LLM(path, task="embed", **ENGINE) as llm:
        with pytest.raises(InvalidInputError, match="not a Matryoshka model"):
            llm.embed(TEXTS[:1], PoolingParams(dimensions=16), use_tqdm=False)


def test_score_is_the_rerankers_yes_probability(qwen3):
    """A decoder reranker (Qwen3-Reranker-shaped): each pair in the reranker's prompt, the
    score softmax([logit_no, logit_yes])[1] at the next position, as transformers
    computes it on the same tokens."""
    from transformers import AutoModelForCausalLM

    # the tiny tokenizer's single-byte tokens stand in for "no" and "yes"
    tokens = {"classifier_from_token": ["n", "y"]}
    query, documents = "what sat on the mat", ["the cat sat on the mat", "hello world"]
    with LLM(qwen3, task="score", pooler_config=tokens, **ENGINE | {"max_model_len": 512}) as llm:
        scores = llm.score(query, documents, use_tqdm=False)
        no, yes = (llm.get_tokenizer().encode(t, add_special_tokens=False)[0] for t in "ny")
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    for output in scores:
        with torch.no_grad():
            logits = hf(torch.tensor([output.prompt_token_ids])).logits[0, -1]
        want = torch.softmax(logits[[no, yes]], dim=0)[1].item()
        assert output.outputs.score == pytest.approx(want, abs=1e-5)
    assert scores[0].outputs.score != scores[1].outputs.score
    assert len(scores[0].prompt_token_ids) > ENGINE["max_num_batched_tokens"]  # chunked


def test_tasks_refuse_each_other(qwen3):
    """And a pooled prompt may fill max_model_len (nothing is generated after it), a
    longer one may not; a prompt to generate from leaves one place."""
    with LLM(qwen3, task="embed", **ENGINE) as llm:
        with pytest.raises(InvalidInputError, match="serves --task embed"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
        full = llm.embed({"prompt_token_ids": [5] * 128}, use_tqdm=False)[0]
        assert len(full.outputs.embedding) == 64
        with pytest.raises(InvalidInputError, match="prompt has 129 tokens"):
            llm.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False)
        with pytest.raises(ValueError, match="task='score'"):
            llm.score("a", "b", use_tqdm=False)
    with LLM(qwen3, **ENGINE) as llm:
        with pytest.raises(InvalidInputError, match="--task embed"):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(InvalidInputError, match="prompt has 128 tokens"):
            llm.generate({"prompt_token_ids": [5] * 128}, use_tqdm=False)


def test_classify_equals_transformers(tmp_path):
    """--task classify on a *ForSequenceClassification checkpoint: each prompt's label
    probabilities as transformers computes them (softmax of the score head at the last
    token); the checkpoint refuses any other task, and a causal LM refuses classify."""
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    from checkpoints import _COMMON

    config = Qwen3Config(**_COMMON, vocab_size=512, head_dim=32, num_labels=3,
                         id2label={0: "neg", 1: "neu", 2: "pos"},
                         label2id={"neg": 0, "neu": 1, "pos": 2})
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 2.0)
    path = str(tmp_path / "classifier")
    hf.save_pretrained(path)
    make_tiny_tokenizer(path)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [300, 301]]
    with LLM(path, task="classify", **ENGINE) as llm:
        got = [o.outputs.probs for o in llm.classify(
            [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    for prompt, probs in zip(prompts, got):
        with torch.no_grad():
            want = torch.softmax(hf(torch.tensor([prompt])).logits[0], dim=0)
        assert torch.allclose(torch.tensor(probs), want, atol=1e-5)
    with pytest.raises(ValueError, match="start it with --task classify"):
        LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="needs a \\*ForSequenceClassification checkpoint"):
        LLM(make_tiny_checkpoint("llama", tmp_path / "llama"), task="classify", **ENGINE)
