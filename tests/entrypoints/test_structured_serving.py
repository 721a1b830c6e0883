"""Structured outputs, tool calls and reasoning through a real `loom serve` on the tiny
random model: whatever the model wants, constrained outputs must parse and validate, with
each --structured-outputs-backend."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer

MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "admin": {"type": "boolean"}},
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]
GBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c] [0-9]'
GBNF_AS_REGEX = r"\[[a-c][0-9](,[a-c][0-9]){0,3}\]"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "what is the weather?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
                        "--structured-outputs-disable-any-whitespace")
    yield server
    assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def client(server):
    return server.openai(timeout=300.0)


@pytest.fixture(scope="module", params=["auto", "xgrammar"])
def backend_server(request, tiny_model_dir):
    """The module's server (--structured-outputs-backend auto: xgrammar serves most of
    these constraints, llguidance checks them), or one with xgrammar alone (which then
    checks each constraint in the API process). llguidance alone: tests/e2e."""
    if request.param == "auto":
        yield request.getfixturevalue("server")
        return
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests", "--structured-outputs-disable-any-whitespace",
                        "--structured-outputs-backend", request.param)
    yield server
    assert server.terminate() == 0, server.output()


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(GBNF_AS_REGEX, text), text


COMPLETION_CONSTRAINTS = [
    ("json", {"guided_json": PERSON}),
    ("json", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "person", "schema": PERSON}}}),
    ("json", {"structured_outputs": {"json": PERSON}}),
    ("json_object", {"response_format": {"type": "json_object"}}),
    ("regex", {"guided_regex": REGEX}),
    ("choice", {"guided_choice": CHOICES}),
    ("grammar", {"guided_grammar": GBNF}),
    ("plain", {"ignore_eos": True}),
]


def test_completions_constrained_beside_plain_requests(backend_server):
    client = backend_server.openai(timeout=300.0)

    def one(args):
        (kind, extra), seed = args
        response = client.completions.create(
            model=MODEL, prompt=f"{kind} please", max_tokens=12 if kind == "plain" else 300,
            temperature=1.0, seed=seed, extra_body=extra)
        return kind, response.choices[0]

    jobs = [(constraint, seed) for seed, constraint in enumerate(COMPLETION_CONSTRAINTS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for kind, choice in results:
        if kind == "plain":
            assert choice.finish_reason == "length"
        else:
            assert choice.finish_reason == "stop", (kind, choice.text)
            check(kind, choice.text)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    if not stream:
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, n=2,
            response_format=response_format)
        for choice in response.choices:
            assert choice.finish_reason == "stop"
            # Constrained output has no free thinking phase: it is all content.
            assert "reasoning_content" not in choice.message.model_extra
            check("json", choice.message.content)
        return
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=5, stream=True,
        response_format=response_format))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check("json", text)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, fragment", [
    ({"guided_json": {"type": "nonsense"}}, "nonsense"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "missing_rule"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured output"),
    ({"guided_choice": []}, "choice"),
])
def test_invalid_constraints_are_400_and_the_server_keeps_serving(backend_server, body,
                                                                  fragment):
    with backend_server.http(timeout=300.0) as http:
        for route, payload in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions", {"messages": MESSAGES})):
            response = http.post(route, json={"model": MODEL, "max_tokens": 5, **payload, **body})
            assert response.status_code == 400, response.text
            assert fragment in response.json()["error"]["message"]
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10,
                                                "guided_choice": CHOICES})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in CHOICES


# ----------------------------------------------------------------- tools

def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _join_stream(chunks):
    calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tool_call in delta.tool_calls or []:
            call = calls.setdefault(tool_call.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or tool_call.id
            if tool_call.function.name:
                call["name"] = tool_call.function.name
            call["arguments"] += tool_call.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", [0, 1])
def test_named_tool_choice_forces_a_valid_call(client, seed):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
        temperature=1.0, seed=seed)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM report a named tool choice
    _check_calls(choice.message.tool_calls, {"get_weather"})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
        temperature=1.0, seed=seed, stream=True))
    _, calls = _join_stream(chunks)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_forces_valid_calls(client, seed):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=400,
        temperature=1.0, seed=seed)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, set(SCHEMAS))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=400,
        temperature=1.0, seed=seed, stream=True))
    _, calls = _join_stream(chunks)
    assert [c["name"] for c in calls] == [c.function.name for c in choice.message.tool_calls]
    for call in calls:
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# The model "decides" to call a tool in Hermes format (forced here by a grammar, as a
# tiny random model would never do it): reasoning first, then the call.
HERMES_GRAMMAR = ('root ::= "<think>" [a-z]{1,6} "</think>" "<tool_call>" "{\\"name\\": \\"get_weather\\", '
                  '\\"arguments\\": {\\"city\\": \\"" [a-z]{1,6} "\\", \\"days\\": " [1-7] "}}" '
                  '"</tool_call>"')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls_after_reasoning(client, stream):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                  max_tokens=200, temperature=1.0, seed=3,
                  extra_body={"guided_grammar": HERMES_GRAMMAR})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert re.fullmatch("[a-z]{1,6}", choice.message.model_extra["reasoning_content"])
        assert not choice.message.content
        _check_calls(choice.message.tool_calls, {"get_weather"})
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content, calls = _join_stream(chunks)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert re.fullmatch("[a-z]{1,6}", reasoning) and not content
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_errors(server):
    with server.http() as http:
        for tool_choice, fragment in (
                ({"type": "function", "function": {"name": "launch"}}, "not in tools"),
                ("required", None)):
            body = {"model": MODEL, "messages": MESSAGES, "tool_choice": tool_choice}
            if fragment is not None:
                body["tools"] = TOOLS
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "tool_choice"


# ----------------------------------------------------------------- reasoning

@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_from_content(client, stream):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=11,
                  extra_body={"guided_grammar": 'root ::= "<think>" [a-z]{3,8} "</think>" [a-z]{3,8}'})
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert re.fullmatch("[a-z]{3,8}", message.model_extra["reasoning_content"])
        assert re.fullmatch("[a-z]{3,8}", message.content)
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert re.fullmatch("[a-z]{3,8}", reasoning) and re.fullmatch("[a-z]{3,8}", content)
    assert "<" not in reasoning + content


@pytest.mark.parametrize("max_tokens", [100, 3, 6])
def test_streamed_and_whole_replies_agree_on_reasoning_and_content(client, max_tokens):
    """The same seeded request, whole and streamed, split into the same reasoning and
    content, with the same finish reason, also when max_tokens cuts it inside the
    thinking or just after it."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0,
                  seed=11,
                  extra_body={"guided_grammar": 'root ::= "<think>" [a-z]{3,8} "</think>" [a-z]{3,8}'})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (reasoning, content) == (whole.message.model_extra.get("reasoning_content") or "",
                                    whole.message.content or "")
    assert finish == [whole.finish_reason]
