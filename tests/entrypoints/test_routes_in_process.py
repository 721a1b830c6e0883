"""The real app's routes in this process, over ScriptedEngine (scripted outputs in
milliseconds): what a client sees of chat, completions and tokenize, full and streamed,
the SamplingParams that reach the engine, the error envelope, and aborts when the
client leaves. The same routes on a real engine: test_serving.py (a subprocess).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from scripted_engine import ScriptedEngine
from tokenizer_fixtures import make_tiny_tokenizer

from loom.async_llm import EngineDeadError, QueueFullError
from loom.entrypoints.openai.server import ServerState, build_app
from loom.tokenizer import load_tokenizer

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def engine(tokenizer, tokenizer_dir) -> ScriptedEngine:
    return ScriptedEngine.on(tokenizer, tokenizer_dir, max_model_len=128)


def serve(engine: ScriptedEngine, **chat_options):
    state = ServerState(engine, MODEL, api_key=None, shutdown_timeout=1.0)
    state.chat_options = chat_options
    return build_app(state)


@pytest.fixture
def client(engine):
    with TestClient(serve(engine)) as client:
        yield client


def events(response) -> list:
    """The JSON payloads of an event stream, then the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    return [data if data == "[DONE]" else json.loads(data) for data in payloads]


def only_request(engine: ScriptedEngine):
    [(request_id, submitted)] = engine.requests.items()
    return request_id, submitted


# ----------------------------------------------------------------- chat

def test_chat_full(client, engine, tokenizer):
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                          "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    request_id, submitted = only_request(engine)
    assert body["id"] == request_id and request_id.startswith("chatcmpl-")
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": "Hello world", "tool_calls": []},
        "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    num_prompt_tokens = len(submitted.prompt_token_ids)
    num_completion_tokens = len(tokenizer.encode("Hello")) + len(tokenizer.encode(" world"))
    assert body["usage"] == {"prompt_tokens": num_prompt_tokens,
                             "completion_tokens": num_completion_tokens,
                             "total_tokens": num_prompt_tokens + num_completion_tokens}
    assert submitted.prompt_token_ids == tokenizer.apply_chat_template(MESSAGES,
                                                                       add_generation_prompt=True)
    assert not submitted.stream and submitted.params.max_tokens == 5
    assert engine.aborted == []


def test_chat_stream(client, engine):
    response = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    *chunks, usage, done = events(response)
    assert done == "[DONE]"
    request_id, submitted = only_request(engine)
    assert submitted.stream
    assert {chunk["id"] for chunk in chunks} == {request_id}
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " world"}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "stop"]
    assert all(chunk["usage"] is None for chunk in chunks)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(
        submitted.prompt_token_ids)
    # Without a max_tokens, what the context leaves.
    assert submitted.params.max_tokens == 128 - len(submitted.prompt_token_ids)
    assert engine.aborted == []


def test_chat_n_choices(client, engine):
    engine.replies = [["a", "b"], ["c"]]
    full = client.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 2}).json()
    assert [(c["index"], c["message"]["content"]) for c in full["choices"]] == [(0, "ab"), (1, "c")]
    streamed = events(client.post("/v1/chat/completions",
                                  json={"messages": MESSAGES, "n": 2, "stream": True}))
    deltas = [(c["index"], c["delta"], c["finish_reason"])
              for event in streamed[:-1] for c in event["choices"]]
    assert deltas == [(0, {"role": "assistant", "content": ""}, None),
                      (1, {"role": "assistant", "content": ""}, None),
                      (0, {"content": "a"}, None), (1, {"content": "c"}, "stop"),
                      (0, {"content": "b"}, "stop")]
    assert all(submitted.params.n == 2 for submitted in engine.requests.values())


def test_chat_logprobs(client, engine, tokenizer):
    engine.replies = [["Hello"]]
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True,
                                                      "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    token_ids = tokenizer.encode("Hello")
    assert [item["token"] for item in content] == [tokenizer.decode([t]) for t in token_ids]
    for item, token_id in zip(content, token_ids):
        assert item["logprob"] == -0.25 and item["bytes"] == list(item["token"].encode())
        assert [top["logprob"] for top in item["top_logprobs"]] == [-0.25, -1.0]
        assert item["top_logprobs"][1]["token"] == tokenizer.decode([token_id + 1])
    _, submitted = only_request(engine)
    assert submitted.params.logprobs == 2


def test_model_defaults_fill_what_the_request_leaves_out(tokenizer, tokenizer_dir):
    engine = ScriptedEngine.on(tokenizer, tokenizer_dir,
                               sampling_defaults=(("temperature", 0.5), ("max_tokens", 7)))
    with TestClient(serve(engine)) as client:
        client.post("/v1/chat/completions", json={"messages": MESSAGES})
        client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0.0,
                                                  "max_completion_tokens": 3})
    (_, default), (_, given) = engine.requests.items()
    assert (default.params.temperature, default.params.max_tokens) == (0.5, 7)
    assert (given.params.temperature, given.params.max_tokens) == (0.0, 3)


# ----------------------------------------------------------------- tools and reasoning

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_reasoning_and_auto_tool_calls(engine):
    engine.replies = [["<think>look it up", "</think>", CALL]]
    app = serve(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                reasoning_parser="qwen3")
    with TestClient(app) as client:
        full = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        streamed = events(client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "stream": True}))
    choice = full.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "look it up"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    deltas = [event["choices"][0]["delta"] for event in streamed[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "look it up"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert streamed[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_tool_choice_constrains_the_output(client, engine):
    engine.replies = [['{"city": ', '"Paris"}']]
    body = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json()
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    _, submitted = only_request(engine)
    assert submitted.params.structured_outputs.json == TOOLS[0]["function"]["parameters"]


# ----------------------------------------------------------------- completions

def test_completion_full_batch_and_n(client, engine, tokenizer):
    engine.replies = [["x"], ["y", "z"]]
    body = client.post("/v1/completions", json={"prompt": ["hi", "hello"], "n": 2,
                                                "max_tokens": 4}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x", "stop"), (1, "yz", "stop"), (2, "x", "stop"), (3, "yz", "stop")]
    prompt_tokens = len(tokenizer.encode("hi")) + len(tokenizer.encode("hello"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert sorted(engine.requests) == [f"{body['id']}-0", f"{body['id']}-1"]
    assert {s.params.max_tokens for s in engine.requests.values()} == {4}


def test_completion_stream(client, engine):
    response = client.post("/v1/completions", json={
        "prompt": [5, 6, 7], "stream": True, "stream_options": {"include_usage": True}})
    *chunks, usage, done = events(response)
    assert done == "[DONE]"
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("Hello", None), (" world", "stop")]
    assert usage["usage"]["prompt_tokens"] == 3
    _, submitted = only_request(engine)
    assert submitted.prompt_token_ids == [5, 6, 7] and submitted.params.max_tokens == 16


def test_completion_echo_with_logprobs(client, engine, tokenizer):
    engine.replies = [["Hello"]]
    prompt_ids = tokenizer.encode("hi there")
    for stream in (False, True):
        response = client.post("/v1/completions", json={
            "prompt": "hi there", "echo": True, "logprobs": 1, "stream": stream})
        choice = (events(response)[0] if stream else response.json())["choices"][0]
        assert choice["text"] == "hi thereHello"
        logprobs = choice["logprobs"]
        num_tokens = len(prompt_ids) + len(tokenizer.encode("Hello"))
        assert len(logprobs["tokens"]) == num_tokens
        assert logprobs["token_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == [-0.25] * (num_tokens - 1)
        assert logprobs["text_offset"][0] == 0
    assert all(s.params.prompt_logprobs == 1 for s in engine.requests.values())


# ----------------------------------------------------------------- tokenize

def test_tokenize_and_detokenize(client, tokenizer):
    counted = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert counted["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert counted["max_model_len"] == 128
    tokens = client.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "hello"}


# ----------------------------------------------------------------- errors

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
_LONG = "a" * 200
ERROR_CASES = [
    # (path, body, status, param, code); None for a body: not JSON.
    (COMPLETION, None, 400, None, None),
    (COMPLETION, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    (COMPLETION, {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    (COMPLETION, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    (COMPLETION, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (COMPLETION, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", None),
    (COMPLETION, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (COMPLETION, {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs", None),
    (COMPLETION, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    (COMPLETION, {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias", None),
    (COMPLETION, {"prompt": "hi", "stop_token_ids": [256]}, 400, "stop_token_ids", None),
    (COMPLETION, {"prompt": "hi", "allowed_token_ids": [999]}, 400, "allowed_token_ids", None),
    (COMPLETION, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids", None),
    (COMPLETION, {"prompt": "hi", "bad_words": [" "]}, 400, "bad_words", None),
    (COMPLETION, {"prompt": "hi", "priority": 1}, 400, "priority", None),  # fcfs here
    (COMPLETION, {"prompt": "hi", "priority": "high"}, 400, "priority", None),
    (CHAT, {"messages": MESSAGES, "bad_words": "hi"}, 400, "bad_words", None),
    (COMPLETION, {"prompt": "hi", "suffix": "!"}, 400, "suffix", None),
    (COMPLETION, {"prompt": "hi", "best_of": 3}, 400, "best_of", None),
    (COMPLETION, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    (COMPLETION, {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice", None),
    (COMPLETION, {"prompt": [[5], [999]]}, 400, "prompt", None),
    (COMPLETION, {"prompt": []}, 400, "prompt", None),
    (COMPLETION, {"prompt": _LONG}, 400, "prompt", "context_length_exceeded"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 200}, 400, "prompt", "context_length_exceeded"),
    (COMPLETION, {"prompt": "hi", "model": "gpt-9"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     None),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 200}, 400, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": _LONG}]}, 400, "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}, 400, "tool_choice",
     None),
    (CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs", None),
    (CHAT, {"messages": MESSAGES, "model": "nope"}, 404, "model", "model_not_found"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, None, None),
    ("/detokenize", {"tokens": [3, 256]}, 400, "tokens", None),
]


def test_structured_outputs_off_is_a_400_naming_the_flag(tokenizer, tokenizer_dir):
    """--structured-outputs-backend off (the seed's --guided-decoding-backend off): a
    request that asks for a grammar, in any of its spellings, gets a 400 that names the
    flag; one that does not is served."""
    from loom.config import StructuredOutputsConfig
    from loom.input_processor import InputProcessor

    engine = ScriptedEngine.on(tokenizer, tokenizer_dir, max_model_len=128)
    engine.input_processor = InputProcessor(engine.config.model, tokenizer,
                                            StructuredOutputsConfig(backend="off"))
    with TestClient(serve(engine)) as client:
        for path, body in (
                (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_object"}}),
                (COMPLETION, {"prompt": "hi", "guided_regex": "[a-z]+"}),
                (COMPLETION, {"prompt": "hi", "structured_outputs": {"choice": ["a", "b"]}})):
            response = client.post(path, json={**body, "max_tokens": 2})
            assert response.status_code == 400, response.text
            assert "--structured-outputs-backend off" in response.json()["error"]["message"]
        assert client.post(COMPLETION, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_max_logprobs_is_the_server_s_setting(tokenizer, tokenizer_dir):
    """--max-logprobs 3: three logprobs are served, four are a 400 naming the request's
    field (completions: logprobs; chat: top_logprobs), saying the limit."""
    engine = ScriptedEngine.on(tokenizer, tokenizer_dir, max_model_len=128, max_logprobs=3)
    with TestClient(serve(engine)) as client:
        for path, body, field in (
                (COMPLETION, {"prompt": "hi", "max_tokens": 2, "logprobs": 4}, "logprobs"),
                (CHAT, {"messages": MESSAGES, "max_completion_tokens": 2, "logprobs": True,
                        "top_logprobs": 4}, "top_logprobs")):
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == field and "at most 3" in error["message"]
            body[field] = 3
            assert client.post(path, json=body).status_code == 200
            assert list(engine.requests.values())[-1].params.logprobs == 3


@pytest.mark.parametrize("path, body, status, param, code", ERROR_CASES,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(ERROR_CASES)])
def test_bad_requests_name_their_field(client, engine, path, body, status, param, code):
    content = b"{not json" if body is None else json.dumps(body).encode()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", param, code), error
    assert engine.requests == {}  # nothing reached the engine


def test_queue_full_is_a_503(client, engine):
    engine.refuse_with = QueueFullError("at most 0 may wait")
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"


def test_engine_failures_mid_request(client, engine):
    engine.fail_stream_with = EngineDeadError("the core exited")
    streamed = events(client.post("/v1/chat/completions",
                                  json={"messages": MESSAGES, "stream": True}))
    assert streamed[-2]["error"]["code"] == "engine_dead" and streamed[-1] == "[DONE]"
    engine.fail_stream_with = None
    engine.finish_reason, engine.stop_reason = "error", "a worker raised"
    full = client.post("/v1/completions", json={"prompt": "hi"})
    assert full.status_code == 500 and "a worker raised" in full.json()["error"]["message"]


# ----------------------------------------------------------------- the client leaves

def _post(path: str) -> dict:
    raw = path.encode()
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": raw,
            "query_string": b"", "root_path": "", "client": ("client", 1),
            "server": ("loom", 80), "headers": [(b"content-type", b"application/json")]}


def _leave_when(app, path: str, body: dict, gone) -> list[dict]:
    """Call the app as a server would; the client disconnects once ``gone(sent)`` is
    true of the messages sent so far. Returns what was sent."""
    sent: list[dict] = []

    async def receive() -> dict:
        if not receive.body_read:
            receive.body_read = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        while not gone(sent):
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    receive.body_read = False

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        await asyncio.wait_for(app(_post(path), receive, send), timeout=10)

    asyncio.run(run())
    return sent


def test_client_leaving_a_stream_aborts_it(engine):
    engine.hold_after = 1  # one output, then the engine keeps generating
    sent = _leave_when(serve(engine), "/v1/chat/completions",
                       {"messages": MESSAGES, "stream": True},
                       lambda sent: any(b"Hello" in m.get("body", b"") for m in sent))
    assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
    assert engine.aborted == list(engine.requests) and len(engine.aborted) == 1


def test_client_leaving_a_batch_stream_aborts_every_prompt(engine):
    engine.hold_after = 1
    _leave_when(serve(engine), "/v1/completions",
                {"prompt": ["hi", "there", "you"], "stream": True},
                lambda sent: sum(b"Hello" in m.get("body", b"") for m in sent) == 3)
    assert sorted(engine.aborted) == sorted(engine.requests) and len(engine.aborted) == 3


def test_client_leaving_a_full_request_aborts_it(engine):
    engine.hold_after = 0
    sent = _leave_when(serve(engine), "/v1/completions", {"prompt": "hi"},
                       lambda sent: bool(engine.requests))
    assert sent[0]["status"] == 499
    assert engine.aborted == list(engine.requests) and len(engine.aborted) == 1
