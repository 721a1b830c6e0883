"""The reasoning budget over the server: a chat request's thinking_token_budget
(FastDeploy's reasoning_max_tokens, OpenAI's reasoning_effort) gives exactly that many
tokens of reasoning_content, whole and streamed; budget 0 turns the template's thinking
off; a bad budget is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from checkpoints import make_tiny_checkpoint
from loom_server import LoomServer
from tokenizer_fixtures import THINK_END_ID, make_tiny_thinking_tokenizer

from loom.tokenizer import load_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("thinking"), vocab_size=258)
    return make_tiny_thinking_tokenizer(path)


@pytest.fixture(scope="module")
def client(thinking_model):
    """``loom serve`` on the thinking model, its budgets set by flags."""
    server = LoomServer(thinking_model, "--kv-cache-memory", "32MiB", "--max-model-len", "256",
                        "--dtype", "float32", "--reasoning-parser", "deepseek_r1",
                        "--reasoning-effort-budgets", '{"low": 2}', "--no-enable-warm-up")
    try:
        with server.http() as client:
            yield client
    finally:
        server.kill()


@pytest.fixture(scope="module")
def free_thought(thinking_model) -> list[int]:
    """Unlimited greedy thinking from the chat's prompt, by token id (offline, the same
    float32 model)."""
    from loom import LLM, SamplingParams

    llm = LLM(thinking_model, dtype="float32", max_model_len=256)
    try:
        out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                thinking_token_budget=-1), use_tqdm=False)
    finally:
        llm.shutdown()
    ids = list(out[0].outputs[0].token_ids)
    assert THINK_END_ID not in ids
    return ids


def chat(client, stream: bool, **fields) -> tuple[str, str]:
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": stream, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()["choices"][0]["message"]
        return message.get("reasoning_content") or "", message.get("content") or ""
    reasoning = content = ""
    for line in response.text.split("\n\n"):
        data = line.removeprefix("data: ")
        if not data or data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
    return reasoning, content


@pytest.mark.parametrize("fields, budget", [({"thinking_token_budget": 3}, 3),
                                            ({"reasoning_max_tokens": 4}, 4),
                                            ({"reasoning_effort": "low"}, 2)])
def test_the_budget_is_the_reasoning_whole_and_streamed(client, thinking_model, free_thought,
                                                        fields, budget):
    expected = load_tokenizer(thinking_model).decode(free_thought[:budget])
    whole = chat(client, False, **fields)
    assert whole[0] == expected and whole[1]
    assert chat(client, True, **fields) == whole


def test_budget_zero_turns_the_template_s_thinking_off(client):
    reasoning, content = chat(client, False, thinking_token_budget=0)
    assert reasoning == "" and content


@pytest.mark.parametrize("fields, param", [({"thinking_token_budget": -2}, "thinking_token_budget"),
                                           ({"reasoning_max_tokens": "x"}, "reasoning_max_tokens"),
                                           ({"reasoning_effort": "max"}, "reasoning_effort")])
def test_bad_budgets_are_400s_naming_the_field(client, fields, param):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
