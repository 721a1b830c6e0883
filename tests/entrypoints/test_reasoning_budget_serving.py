"""The reasoning budget over the server: a chat request's thinking_token_budget
(FastDeploy's reasoning_max_tokens, OpenAI's reasoning_effort) gives exactly that many
tokens of reasoning_content, whole and streamed; budget 0 turns the template's thinking
off; a bad budget is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from loom_server import LoomServer
from tokenizer_fixtures import THINK_END_ID, make_tiny_thinking_model

from loom.tokenizer import load_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return make_tiny_thinking_model(str(tmp_path_factory.mktemp("thinking")))


@pytest.fixture(scope="module")
def client(thinking_model):
    """``loom serve`` on the thinking model, its budgets set by flags."""
    server = LoomServer(thinking_model, "--kv-cache-memory", "32MiB", "--max-model-len", "256",
                        "--dtype", "float32", "--reasoning-parser", "deepseek_r1",
                        "--reasoning-effort-budgets", '{"low": 2}', "--no-enable-warm-up",
                        # compact JSON: a random model fills every free whitespace run
                        "--structured-outputs-disable-any-whitespace")
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


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_constrains_only_the_answer_after_the_thinking(client, thinking_model,
                                                                free_thought, stream):
    """With a reasoning parser, the grammar starts after </think>: the thinking is the
    model's own (here the budget's 4 tokens, greedy as without a schema), the answer
    parses against the schema; n = 2 random choices too."""
    import jsonschema

    fields = {"thinking_token_budget": 4, "max_tokens": 64, "ignore_eos": False,
              "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    reasoning, content = chat(client, stream, **fields)
    assert reasoning == load_tokenizer(thinking_model).decode(free_thought[:4])
    jsonschema.validate(json.loads(content), SCHEMA)
    response = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 5, **fields})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["message"]["reasoning_content"]


def test_required_tool_calls_come_after_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
        "additionalProperties": False}}}]
    response = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": tools, "tool_choice": "required", "max_tokens": 200,
        "parallel_tool_calls": False,
        "temperature": 0, "thinking_token_budget": 3})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"]
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add" and json.loads(call["arguments"]) in ({"a": 1}, {"a": 2})


def test_the_same_under_speculative_decoding(thinking_model, free_thought):
    """With ngram speculation on, a budget's thinking and a schema's answer come out as
    without it (constrained requests take no drafts; the thinking's forced </think> is
    checked at every verified position)."""
    import jsonschema

    server = LoomServer(thinking_model, "--kv-cache-memory", "32MiB", "--max-model-len", "256",
                        "--dtype", "float32", "--reasoning-parser", "deepseek_r1",
                        "--no-enable-warm-up", "--structured-outputs-disable-any-whitespace",
                        "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    try:
        with server.http() as client:
            reasoning, content = chat(client, False, thinking_token_budget=5)
            assert reasoning == load_tokenizer(thinking_model).decode(free_thought[:5])
            reasoning, content = chat(client, True, thinking_token_budget=4, max_tokens=64,
                                      ignore_eos=False,
                                      structured_outputs={"json": SCHEMA,
                                                          "disable_any_whitespace": True})
            assert reasoning == load_tokenizer(thinking_model).decode(free_thought[:4])
            jsonschema.validate(json.loads(content), SCHEMA)
    finally:
        server.kill()
