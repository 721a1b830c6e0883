"""A reasoning budget enforced in the engine: a thinking model (a template that opens
<think>) thinks for exactly the budget's tokens, then </think> is forced (after the
budget message's tokens, if set) and the answer follows as greedy decoding would give it
from there; checked token by token, offline here and over the server in
tests/entrypoints/test_reasoning_budget_serving.py."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import THINK_END_ID, THINK_START_ID, make_tiny_thinking_model

from loom import LLM, SamplingParams
from loom.input_processor import InvalidInputError
from loom.sampling_params import SamplingParamsError

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return make_tiny_thinking_model(str(tmp_path_factory.mktemp("thinking")))


@pytest.fixture(scope="module")
def llm(thinking_model):
    engine = LLM(thinking_model, dtype="float32", max_model_len=256, seed=0)
    yield engine
    engine.shutdown()


def greedy(budget: int | None = None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                          skip_special_tokens=False, thinking_token_budget=budget, **extra)


def continuation(llm, prompt_ids: list[int], tokens: int) -> list[int]:
    """Plain greedy decoding from ``prompt_ids``: what the answer must be after </think>."""
    output = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return list(output[0].outputs[0].token_ids)


def prompt_ids(llm) -> list[int]:
    tokenizer = llm.engine.tokenizer
    text = tokenizer.render_chat_template(MESSAGES, True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert THINK_START_ID in ids  # the template opened the thinking
    return ids


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_budget_of_n_thinks_n_tokens_then_ends_the_thinking(llm, budget):
    prompt = prompt_ids(llm)
    free = continuation(llm, prompt, NEW_TOKENS)
    assert THINK_END_ID not in free[:budget + 1]  # unconstrained, it would think on
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt}],
                       [greedy(budget), greedy()], use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    assert got[:budget] == free[:budget] and got[budget] == THINK_END_ID
    # then the answer, as plain greedy decoding gives it from the forced prefix
    assert got[budget + 1:] == continuation(llm, prompt + got[:budget + 1],
                                            NEW_TOKENS - budget - 1)
    assert list(out[1].outputs[0].token_ids) == free  # its neighbour in the batch: free


def test_the_engine_default_and_its_message(thinking_model):
    """--reasoning-budget 3 --reasoning-budget-message: three tokens of thought, the
    message's tokens, then </think>; a request's own budget (-1) overrides the default."""
    engine = LLM(thinking_model, dtype="float32", max_model_len=256, seed=0,
                 reasoning_budget=3, reasoning_budget_message=" ok.")
    try:
        prompt = prompt_ids(engine)
        message = engine.engine.tokenizer.encode(" ok.", add_special_tokens=False)
        out = engine.generate([{"prompt_token_ids": prompt}] * 2, [
            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            greedy(-1)], use_tqdm=False)
        got, free = (list(o.outputs[0].token_ids) for o in out)
        assert got[:3] == free[:3]
        assert got[3:3 + len(message)] == message and got[3 + len(message)] == THINK_END_ID
        assert THINK_END_ID not in free[:3 + len(message) + 1]
    finally:
        engine.shutdown()


def test_n_samples_and_the_chat_template(llm):
    """n = 2 random samples each think exactly the budget; LLM.chat's prompt opens the
    thinking through the template, and budget 0 there ends it at once."""
    out = llm.chat(MESSAGES, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                                            ignore_eos=True, thinking_token_budget=4),
                   use_tqdm=False)
    for completion in out[0].outputs:
        assert list(completion.token_ids)[4] == THINK_END_ID
        assert THINK_END_ID not in completion.token_ids[:4]


def test_with_speculative_decoding_the_tokens_are_the_same(thinking_model, llm):
    prompt = prompt_ids(llm)
    want = llm.generate([{"prompt_token_ids": prompt}], greedy(6), use_tqdm=False)
    engine = LLM(thinking_model, dtype="float32", max_model_len=256, seed=0,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 1})
    try:
        got = engine.generate([{"prompt_token_ids": prompt}], greedy(6), use_tqdm=False)
    finally:
        engine.shutdown()
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert want[0].outputs[0].token_ids[6] == THINK_END_ID


def test_bad_budgets(llm, tiny_llama):
    with pytest.raises(SamplingParamsError, match="thinking_token_budget must be -1"):
        SamplingParams(thinking_token_budget=-2)
    plain = LLM(tiny_llama, dtype="float32", max_model_len=64)  # no <think> in its tokenizer
    try:
        with pytest.raises(InvalidInputError, match="needs a thinking model"):
            plain.generate(["hi"], greedy(3), use_tqdm=False)
    finally:
        plain.shutdown()
