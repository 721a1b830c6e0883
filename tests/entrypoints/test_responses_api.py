"""OpenAI's Responses API (/v1/responses) through the official openai SDK.

On a real ``loom serve`` (one, shared): greedy text equal to the chat route's for the
same conversation, whole and streamed with the events in the SDK's order; a function
call out and its output in; text.format as structured output; previous_response_id
continuing a stored conversation; retrieve, delete and cancel; every bad input a 4xx in
OpenAI's envelope naming the field; the API key and the metrics as the chat route's.
In this process, over ScriptedEngine: reasoning items, parsed tool calls, the sampling
settings and the reasoning budget that reach the engine, an engine failure mid-stream,
and the store's bound.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from fastapi.testclient import TestClient
from scripted_engine import ScriptedEngine
from tokenizer_fixtures import make_tiny_thinking_tokenizer, make_tiny_tokenizer

from loom.entrypoints.openai.server import ServerState, build_app
from loom.entrypoints.openai_responses import ResponseStore, StoredResponse
from loom.tokenizer import load_tokenizer

KEY = "sk-responses"
GREEDY = {"model": "tiny", "temperature": 0}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False},
        "strict": True}
CHAT_TOOL = {"type": "function", "function": {
    key: value for key, value in TOOL.items() if key not in ("type", "strict")}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes",
                        "--structured-outputs-disable-any-whitespace",
                        "--served-model-name", "tiny", api_key=KEY)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat(server, messages, max_tokens, **extra):
    return server.openai().chat.completions.create(messages=messages, max_tokens=max_tokens,
                                                   **GREEDY, **extra)


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with each run of one delta type collapsed to one."""
    return [kind for i, kind in enumerate(kinds)
            if not (kind.endswith(".delta") and i and kinds[i - 1] == kind)]


def finished(response) -> tuple[str, str | None]:
    reason = response.incomplete_details.reason if response.incomplete_details else None
    return response.status, reason


STATUS = {"length": ("incomplete", "max_output_tokens"), "stop": ("completed", None),
          "tool_calls": ("completed", None)}


# ----------------------------------------------------------------- a real server

def test_text_whole_and_streamed_equals_the_chat_route(server, client):
    want = chat(server, [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Say something."}], 12)
    text = want.choices[0].message.content
    response = client.responses.create(instructions="Be brief.", input="Say something.",
                                       max_output_tokens=12, **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == text and response.model == "tiny"
    assert finished(response) == STATUS[want.choices[0].finish_reason]
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (want.usage.prompt_tokens,
                                             want.usage.completion_tokens,
                                             want.usage.total_tokens)
    # The same conversation as items (developer is a system message), streamed.
    events = list(client.responses.create(
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Say something."}]}],
        max_output_tokens=12, stream=True, **GREEDY))
    kinds = [event.type for event in events]
    last = "response.incomplete" if response.status == "incomplete" else "response.completed"
    assert collapsed(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS, last]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type.endswith(".delta")) == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.output_tokens == response.usage.output_tokens


def test_function_call_out_and_its_output_in(server, client):
    response = client.responses.create(input="Weather?", tools=[TOOL], tool_choice="required",
                                       max_output_tokens=64, **GREEDY)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    assert response.status == "completed"
    with client.responses.stream(input="Weather?", tools=[TOOL], tool_choice="required",
                                 max_output_tokens=64, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert collapsed(kinds)[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    [streamed_call] = streamed.output
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    # The call and its output back in: the prompt is the chat route's for the same turns.
    follow = client.responses.create(
        input=[{"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        tools=[TOOL], tool_choice="none", max_output_tokens=4, **GREEDY)
    want = chat(server, [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": "", "tool_calls": [{
                             "id": call.call_id, "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}],
                4, tools=[CHAT_TOOL], tool_choice="none")
    assert follow.usage.input_tokens == want.usage.prompt_tokens > response.usage.input_tokens
    assert follow.output_text == want.choices[0].message.content


def test_json_schema_text_format(client):
    response = client.responses.create(
        input="Where?", max_output_tokens=32, **GREEDY,
        text={"format": {"type": "json_schema", "name": "place", "strict": True,
                         "schema": TOOL["parameters"]}})
    assert json.loads(response.output_text) in ({"city": "Paris"}, {"city": "Oslo"})
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(server, client):
    events = list(client.responses.create(instructions="Be brief.", input="Say something.",
                                          max_output_tokens=4, stream=True, **GREEDY))
    first = events[-1].response  # streamed, and stored as well
    second = client.responses.create(input="And again.", previous_response_id=first.id,
                                     max_output_tokens=4, **GREEDY)
    # The instructions of the first are not carried over (OpenAI's rule).
    want = chat(server, [{"role": "user", "content": "Say something."},
                         *([{"role": "assistant", "content": first.output_text}]
                           if first.output_text else []),
                         {"role": "user", "content": "And again."}], 4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == want.usage.prompt_tokens
    assert second.output_text == want.choices[0].message.content


def test_retrieve_delete_and_cancel(client):
    response = client.responses.create(input="Hi", max_output_tokens=2, metadata={"k": "v"},
                                       user="someone", **GREEDY)
    got = client.responses.retrieve(response.id)
    assert got.model_dump() == response.model_dump()
    assert got.metadata == {"k": "v"} and got.user == "someone" and got.store
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    unstored = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


BAD_INPUT = [  # (body, the param the 400 names)
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "function", "parameters": {}}]}, "tools"),
    ({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 600}, "input"),  # as the chat route's "messages"
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
]


def test_bad_input_is_a_400_naming_the_field(server):
    with server.http() as http:
        for body, param in BAD_INPUT:
            response = http.post("/v1/responses", json={"model": "tiny", **body})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", \
                (body, error)
        assert http.post("/v1/responses", content=b"{not json").status_code == 400
        missing = http.post("/v1/responses", json={"model": "other", "input": "Hi"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        for response in (http.get("/v1/responses"),  # no such method: 405
                         http.post("/v1/responses", json={"input": "Hi"},
                                   headers={"Authorization": "Bearer wrong"})):
            assert response.status_code in (401, 405), response.text
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).responses.create(
            input="Hi", **GREEDY)


def test_metrics_count_responses_as_chat_requests(server, client):
    before = server.metric("vllm:prompt_tokens_total")
    response = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    after = server.wait_for_metric("vllm:prompt_tokens_total",
                                   before + response.usage.input_tokens)
    assert after == before + response.usage.input_tokens


# ----------------------------------------------------------------- in this process

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer")))


@pytest.fixture
def engine(tokenizer_dir) -> ScriptedEngine:
    return ScriptedEngine.on(load_tokenizer(tokenizer_dir), tokenizer_dir, max_model_len=128)


def scripted_client(engine: ScriptedEngine, **chat_options):
    state = ServerState(engine, "tiny", api_key=None, shutdown_timeout=1.0)
    state.chat_options = chat_options
    return TestClient(build_app(state))


def sdk(http: TestClient) -> openai.OpenAI:
    """The openai SDK over the app in this process: its (httpx2) client hands each
    request to the TestClient."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        answer = http.request(request.method, str(request.url), content=request.read(),
                              headers=dict(request.headers))
        return httpx2.Response(answer.status_code, headers=answer.headers.multi_items(),
                               content=answer.content)

    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(forward)))


def test_reasoning_and_parsed_tool_calls_as_items(engine):
    engine.replies = [["<think>look", " it up", "</think>", "Here:", CALL % "Paris",
                       CALL % "Oslo"]]
    with scripted_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                         reasoning_parser="qwen3") as http:
        client = sdk(http)
        whole = client.responses.create(input="Weather?", tools=[TOOL], model="tiny")
        with client.responses.stream(input="Weather?", tools=[TOOL], model="tiny") as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == [
            "reasoning", "message", "function_call", "function_call"]
        reasoning, message, *calls = response.output
        assert reasoning.content[0].text == "look it up" and message.content[0].text == "Here:"
        assert [json.loads(call.arguments)["city"] for call in calls] == ["Paris", "Oslo"]
        assert response.usage.output_tokens_details.reasoning_tokens > 0
    reasoning_events = ["response.output_item.added", "response.content_part.added",
                        "response.reasoning_text.delta", "response.reasoning_text.done",
                        "response.content_part.done", "response.output_item.done"]
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert collapsed(kinds) == ["response.created", "response.in_progress", *reasoning_events,
                                *TEXT_EVENTS, *call_events, *call_events,
                                "response.completed"]
    # The output, sent back as input, is the assistant turn with its reasoning and calls.
    follow = sdk_prompt(engine, {"input": [{"role": "user", "content": "Weather?"},
                                           *[item.model_dump(exclude_none=True)
                                             for item in whole.output]]})
    want = chat_prompt(engine, [{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": "Here:",
                                 "reasoning_content": "look it up"}])
    assert follow == want


def sdk_prompt(engine: ScriptedEngine, body: dict) -> list[int]:
    """The prompt token ids a Responses request reaches the engine with."""
    engine.requests.clear()
    with scripted_client(engine) as http:
        assert http.post("/v1/responses", json=body).status_code == 200
    [submitted] = engine.requests.values()
    return submitted.prompt_token_ids


def chat_prompt(engine: ScriptedEngine, messages: list[dict]) -> list[int]:
    engine.requests.clear()
    with scripted_client(engine) as http:
        assert http.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    [submitted] = engine.requests.values()
    return submitted.prompt_token_ids


def test_sampling_settings_and_reasoning_effort_reach_the_engine(tmp_path):
    thinking_dir = make_tiny_thinking_tokenizer(str(tmp_path))  # has <think> and </think>
    engine = ScriptedEngine.on(load_tokenizer(thinking_dir), thinking_dir, max_model_len=128)
    body = {"input": "Hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9}
    for options, budget in (({}, None), ({"reasoning_parser": "qwen3"}, 1024)):
        engine.requests.clear()
        with scripted_client(engine, **options) as http:
            for effort in ("low", "none"):
                response = http.post("/v1/responses", json={**body, "reasoning": {
                    "effort": effort}})
                assert response.status_code == 200, response.text
        low, none = engine.requests.values()
        assert (low.params.max_tokens, low.params.temperature, low.params.top_p) == (7, 0.5, 0.9)
        # The effort is the reasoning budget only with a reasoning parser.
        assert low.params.thinking_token_budget == budget
        assert none.params.thinking_token_budget == (0 if budget else None)


def test_engine_failure_mid_stream_is_response_failed(engine):
    engine.replies = [["Hello", " world"]]
    engine.fail_stream_with = RuntimeError("the engine broke")
    with scripted_client(engine) as http:
        events = list(sdk(http).responses.create(input="Hi", model="tiny", stream=True))
        assert http.get(f"/v1/responses/{events[0].response.id}").status_code == 404
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert "the engine broke" in events[-1].response.error.message


def test_store_keeps_the_last_responses():
    store = ResponseStore(capacity=2)
    for index in range(3):
        store.put(StoredResponse({"id": f"resp_{index}"}, []))
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    assert store.pop("resp_1") is not None and store.get("resp_1") is None
