"""Property-based fuzzing of every route of a real `loom serve` on the tiny model.

For any request at all, the server must:

- answer it (no dropped connection) and never with a 5xx;
- give every 4xx OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``;
- send strict JSON (no NaN), or an event stream of JSON events ending in ``[DONE]``
  with no server error inside;
- still serve a normal request afterwards.

Request bodies come from the JSON schemas of the routes' pydantic request models (the
server's /openapi.json when it serves one, else protocol.py's models), with hostile
values mixed in at every field: wrong types, huge and negative numbers, NaN and
Infinity, empty and deeply nested containers, lone surrogates, special tokens, broken
regexes and grammars. Raw bodies that are not JSON at all (invalid UTF-8, truncated,
10^5 levels deep) and wrong methods and query strings go to every route.

CI runs ~160 examples in all, derandomized. A longer, random run:
``scripts/fuzz_api.sh [EXAMPLES]`` (sets LOOM_FUZZ_EXAMPLES). Every defect the fuzzer
found stays below as an explicit regression case (REGRESSIONS).
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom_server import TINY_SERVER_ARGS, LoomServer

from loom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny"
TOTAL_EXAMPLES = int(os.environ.get("LOOM_FUZZ_EXAMPLES", "0")) or 160
LONG_RUN = "LOOM_FUZZ_EXAMPLES" in os.environ
# The share of the examples each test gets (they sum to 1).
SHARES = {"/v1/completions": 0.28, "/v1/chat/completions": 0.34, "/tokenize": 0.08,
          "/detokenize": 0.06, "every route": 0.24}
# The routes without a body; the POST routes' bodies come from their models.
KNOWN_ROUTES = {("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"),
                ("GET", "/metrics"), ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions")}
FALLBACK_BODY_MODELS = {"/v1/completions": CompletionRequest,
                        "/v1/chat/completions": ChatCompletionRequest}
ENVELOPE_KEYS = {"message", "type", "param", "code"}
GENERATING_ROUTES = ("/v1/completions", "/v1/chat/completions")
# (path, status, the error's param) of every example, printed after a long run
STATUSES: collections.Counter[tuple[str, int, str]] = collections.Counter()


def fuzz_settings(share: str):
    return settings(
        max_examples=max(5, round(TOTAL_EXAMPLES * SHARES[share])), deadline=None,
        derandomize=not LONG_RUN, database=None, print_blob=True,
        suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------- the server under test

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A short context keeps every generation cheap; tools and reasoning parsers on, so
    # their paths are fuzzed too.
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--max-model-len", "64",
                        "--served-model-name", MODEL, "--disable-log-requests",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3")
    yield server
    if LONG_RUN:  # what the examples reached, for tuning the strategies (pytest -s)
        for (path, status, param), count in sorted(STATUSES.items()):
            print(f"{path:24} {status} {param:24} {count}")
    assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def http(server):
    with server.http(timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def api(http) -> tuple[dict[tuple[str, str], dict | None], dict[str, Any]]:
    """({(method, path): body schema or None}, schema definitions) of the running server."""
    response = http.get("/openapi.json")
    if response.status_code != 200:
        return _api_from_models()
    spec = response.json()
    routes: dict[tuple[str, str], dict | None] = {}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            routes[(method.upper(), path)] = body["schema"] if body else None
    assert KNOWN_ROUTES <= set(routes), set(routes)
    return routes, spec.get("components", {}).get("schemas", {})


def _api_from_models() -> tuple[dict[tuple[str, str], dict | None], dict[str, Any]]:
    routes: dict[tuple[str, str], dict | None] = dict.fromkeys(KNOWN_ROUTES)
    definitions: dict[str, Any] = {}
    for path, model in FALLBACK_BODY_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        definitions.update(schema.pop("$defs", {}))
        definitions[model.__name__] = schema
        routes[("POST", path)] = {"$ref": f"#/components/schemas/{model.__name__}"}
    return routes, definitions


# ----------------------------------------------------------------- the properties

def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)


def check_exchange(http: httpx.Client, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None,
                   params: dict[str, str] | None = None) -> int:
    """Send one request and check every property; returns the status."""
    what = f"{method} {path} params={params} body={body!r}"
    try:
        with http.stream(method, path, content=body, headers=headers, params=params) as response:
            raw = response.read()
    except httpx.TransportError as error:
        pytest.fail(f"connection dropped ({error!r}) on {what}")
    status = response.status_code
    STATUSES[(path, status, _error_param(raw) if status >= 400 else "")] += 1
    assert status < 500, f"{status} {raw[:1000]!r} on {what}"
    content_type = response.headers.get("content-type", "")
    anthropic = path.startswith("/v1/messages")  # Anthropic's shapes there
    if status >= 400:
        if method != "HEAD":
            (_check_anthropic_error if anthropic else _check_envelope)(strict_json(raw), what)
    elif content_type.startswith("text/event-stream") and anthropic:
        events = [json.loads(line[6:]) for line in raw.decode("utf-8").split("\n")
                  if line.startswith("data: ")]
        assert events and events[-1]["type"] in ("message_stop", "error"), what
    elif content_type.startswith("text/event-stream"):
        finished = _check_event_stream(raw, what)
        if method == "POST" and path in GENERATING_ROUTES:
            assert finished == set(range(_num_choices(path, body))), f"{finished} on {what}"
    elif content_type.startswith("application/json"):
        payload = strict_json(raw)
        if method == "POST" and path in GENERATING_ROUTES:
            indices = sorted(choice["index"] for choice in payload["choices"])
            assert indices == list(range(_num_choices(path, body))), f"{indices} on {what}"
            assert all(choice["finish_reason"] for choice in payload["choices"]), what
    check_still_serving(http, what)
    return status


def _num_choices(path: str, body: bytes) -> int:
    """How many choices an accepted request asks for: n per prompt."""
    request = json.loads(body)
    prompt = request.get("prompt")
    num_prompts = (len(prompt) if path == "/v1/completions" and isinstance(prompt, list)
                   and prompt and not isinstance(prompt[0], int) else 1)
    return request.get("n", 1) * num_prompts


def _error_param(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["param"])
    except (ValueError, KeyError, TypeError):
        return "?"


def _check_envelope(payload: Any, what: str) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, f"{payload} on {what}"
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == ENVELOPE_KEYS, f"{payload} on {what}"
    assert isinstance(error["message"], str) and error["message"], f"{payload} on {what}"
    assert isinstance(error["type"], str), f"{payload} on {what}"


def _check_anthropic_error(payload: Any, what: str) -> None:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    assert isinstance(payload, dict) and payload.get("type") == "error", f"{payload} on {what}"
    error = payload.get("error")
    assert isinstance(error, dict) and set(error) == {"type", "message"}, f"{payload} on {what}"
    assert isinstance(error["message"], str) and error["message"], f"{payload} on {what}"


def _check_event_stream(raw: bytes, what: str) -> set[int]:
    """Checks the stream; returns the indices of the choices that finished (once each)."""
    events = [line for line in raw.decode("utf-8").split("\n") if line]
    assert events and events[-1] == "data: [DONE]", f"{raw[-300:]!r} on {what}"
    finished: set[int] = set()
    for line in events[:-1]:
        assert line.startswith("data: "), f"{line!r} on {what}"
        event = strict_json(line[len("data: "):].encode())
        if "error" in event:
            _check_envelope(event, what)
            assert event["error"]["type"] != "server_error", f"{event} on {what}"
            continue
        for choice in event.get("choices", ()):
            if choice.get("finish_reason"):
                assert choice["index"] not in finished, f"finished twice: {line} on {what}"
                finished.add(choice["index"])
    return finished


def check_still_serving(http: httpx.Client, after: str) -> None:
    health = http.get("/health")
    assert health.status_code == 200, f"/health {health.status_code} after {after}"
    response = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, f"{response.text} after {after}"
    assert len(response.json()["choices"]) == 1


# ----------------------------------------------------------------- hostile values

def _nested(depth: int, leaf: Any, as_object: bool) -> Any:
    for _ in range(depth):
        leaf = {"a": leaf} if as_object else [leaf]
    return leaf


# Strings a field may legally hold that stress what reads them: special tokens, template
# syntax, stop-sequence look-alikes, broken regexes and grammars, numbers as text.
SPECIAL_STRINGS = [
    "", " ", "\x00", "😀", "\u202e", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<tool_call>", "</tool_call>", "<think>", "</think>", "{{ 1/0 }}", "{% raise %}",
    "data: [DONE]\n\n", "NaN", "Infinity", "-1", "0", "1e309", "0x10", "1_0", " 7", "٣", "(",
    "[", "a{99999}", "(a*)*b", "\\", "root ::= root", "root ::= ", "function", "text",
    "json_schema", "json_object", "assistant", "tool", "system", "user", MODEL,
]
# Strings no field can hold: lone surrogates (not UTF-8 at all), 20,000 characters.
HOSTILE_STRINGS = ["\ud800", "\udfff\ud800", "x" * 20000]
HOSTILE_SCALARS = [
    None, True, False, 0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**40,
    -(10**40), 0.5, -0.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf,
    *HOSTILE_STRINGS, *SPECIAL_STRINGS[:12],
]
# Keys for free-form objects: the template's and HF's reserved names (chat_template_kwargs),
# JSON Schema keywords (response_format, guided_json, tool parameters).
SPECIAL_KEYS = [
    "", "tokenize", "return_dict", "chat_template", "tools", "conversation", "documents",
    "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors", "messages",
    "type", "properties", "items", "$ref", "$defs", "pattern", "enum", "const", "anyOf",
    "allOf", "oneOf", "not", "required", "additionalProperties", "minItems", "maxItems",
    "minLength", "maxLength", "minimum", "maximum", "format", "0", "1", "255", "256", "-1",
]

keys = st.one_of(st.sampled_from(SPECIAL_KEYS), st.text(max_size=8),
                 st.integers(-1, 300).map(str))  # token ids, as logit_bias keys them
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(-10, 10),
                         st.text(max_size=10), st.sampled_from(SPECIAL_STRINGS),
                         st.sampled_from(HOSTILE_SCALARS))
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(keys, children, max_size=4)),
    max_leaves=12)
hostile_values = st.one_of(
    st.sampled_from(HOSTILE_SCALARS),
    st.sampled_from([[], {}, [None], [[]], [{}], {"": None}, list(range(600)),
                     _nested(300, 1, False), _nested(300, 1, True), [[1, 2], [3, "x"]]]),
    json_values)


def _rarely(valid: st.SearchStrategy, hostile: st.SearchStrategy, one_in: int):
    return st.integers(0, one_in - 1).flatmap(lambda r: hostile if r == 0 else valid)


# ----------------------------------------------------------------- schema -> strategy

class SchemaStrategies:
    """JSON Schema (pydantic's, OpenAPI's components) -> hypothesis strategies for mostly
    valid values, each field hostile now and then."""

    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions
        self._refs: dict[str, st.SearchStrategy] = {}

    def _ref(self, ref: str) -> st.SearchStrategy:
        name = ref.rsplit("/", 1)[1]
        if name not in self._refs:  # deferred: models may refer to themselves
            self._refs[name] = st.deferred(lambda: self.value(self.definitions[name]))
        return self._refs[name]

    def value(self, schema: dict[str, Any]) -> st.SearchStrategy:
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.value(option) for option in schema[key]])
        if "allOf" in schema:
            return self.value(schema["allOf"][0])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.value({**schema, "type": k}) for k in kind])
        if kind == "object":
            return self.object(schema)
        if kind == "array":
            items = self.value(schema.get("items", {}))
            max_size = min(schema.get("maxItems", 4), 4)
            return st.lists(items, min_size=min(schema.get("minItems", 0), max_size),
                            max_size=max_size)
        if kind == "string":
            text = st.text(min_size=schema.get("minLength", 0), max_size=12)
            return _rarely(text, st.sampled_from(SPECIAL_STRINGS), 4)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            low, high = schema.get("minimum"), schema.get("maximum")
            return st.one_of(st.floats(-3, 3), st.sampled_from([1e-300, 1e-45, 1e300]),
                             st.floats(low, high, allow_nan=False, allow_infinity=False))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return json_values

    def _integer(self, schema: dict[str, Any]) -> st.SearchStrategy:
        low = schema["minimum"] if "minimum" in schema else schema.get("exclusiveMinimum",
                                                                       -(2**64) - 1) + 1
        high = schema["maximum"] if "maximum" in schema else schema.get("exclusiveMaximum",
                                                                        2**64 + 1) - 1
        bounds = st.sampled_from([low, high])
        small_low, small_high = max(low, -2), min(high, 12)
        if small_low > small_high:
            return st.one_of(bounds, st.integers(low, high))
        return _rarely(st.integers(small_low, small_high), bounds, 8)

    def object(self, schema: dict[str, Any]) -> st.SearchStrategy:
        properties = schema.get("properties")
        if not properties:
            extra = schema.get("additionalProperties")
            values = self.value(extra) if isinstance(extra, dict) else json_values
            return st.dictionaries(keys, values, max_size=4)
        required = [name for name in schema.get("required", ()) if name in properties]
        optional = [name for name in properties if name not in required]
        fields = {name: _rarely(self.value(properties[name]), hostile_values, 25)
                  for name in properties}

        @st.composite
        def build(draw) -> dict[str, Any]:
            names = [name for name in required if draw(st.integers(0, 39))]  # a few missing
            if optional:
                names += draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))
            body = {name: draw(fields[name]) for name in names}
            if not draw(st.integers(0, 9)):
                body[draw(keys)] = draw(json_values)  # a field no model has
            return body

        return build()


class Body(bytes):
    """A request body whose repr stays short in hypothesis' reports (some are 100 kB)."""

    def __repr__(self) -> str:
        if len(self) <= 300:
            return f"Body({bytes(self)!r})"
        return f"Body({bytes(self[:300])!r} + ... {len(self)} bytes in all)"


def encode(body: Any) -> Body:
    """JSON as Python writes it: NaN and Infinity as bare words, lone surrogates escaped."""
    return Body(json.dumps(body).encode())


RAW_BODIES = st.one_of(
    st.binary(max_size=40).map(Body),
    st.sampled_from([Body(raw) for raw in [
        b"", b"null", b"[]", b"{}", b"1", b'"x"', b"{", b'{"prompt": "a"', b"\xef\xbb\xbf{}",
        b'{"prompt": "\xff\xfe", "max_tokens": 1}', b'{"prompt": "\xed\xa0\x80"}',
        b'{"messages": [{"role": "user", "content": "\xc3"}]}',
        b"[" * 100_000, b'{"a":' * 50_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"prompt": "hi", "max_tokens": 1e999}', b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "prompt": 5}', b'{"prompt": "hi"} trailing',
        b'{"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true, '
        b'"max_tokens": 3}',
    ]]))
CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain",
                                 "application/json; charset=latin-1",
                                 "application/x-www-form-urlencoded", "multipart/form-data"])


@st.composite
def bodies(draw, schema: dict[str, Any] | None, strategies: SchemaStrategies) -> bytes | None:
    """A body for a route: from its schema (mostly), hostile JSON or raw bytes."""
    choice = draw(st.integers(0, 9))
    if schema is not None and choice < 7:
        return encode(draw(strategies.value(schema)))
    if choice < 9:
        return draw(RAW_BODIES)
    return encode(draw(hostile_values))


def _headers(content_type: str | None) -> dict[str, str] | None:
    return {"content-type": content_type} if content_type else None


# ----------------------------------------------------------------- the fuzz tests

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_fuzz_request_bodies(http, api, path):
    routes, definitions = api
    if ("POST", path) not in routes:
        pytest.skip(f"this server has no POST {path}")
    schema = routes[("POST", path)]
    strategies = SchemaStrategies(definitions)

    @fuzz_settings(path)
    @given(body=bodies(schema, strategies), content_type=CONTENT_TYPES)
    def fuzz(body, content_type):
        check_exchange(http, "POST", path, body, _headers(content_type))

    fuzz()


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
QUERIES = st.dictionaries(st.sampled_from(["timeout", "model", "stream", "q", ""]),
                          st.sampled_from(["nan", "inf", "-1", "0", "1e309", "", "x", "0.001",
                                           "\x00", "%ff"]), max_size=2)


def test_fuzz_every_route(http, api):
    routes, definitions = api
    strategies = SchemaStrategies(definitions)
    paths = sorted({path for _, path in routes} | {"/v1/nothing", "/", "/v1"})

    @fuzz_settings("every route")
    @given(data=st.data())
    def fuzz(data):
        path = data.draw(st.sampled_from(paths), label="path")
        declared = [method for method, p in routes if p == path]
        method = data.draw(st.sampled_from(declared) if declared and data.draw(st.booleans())
                           else st.sampled_from(METHODS), label="method")
        schema = routes.get((method, path))
        body = data.draw(bodies(schema, strategies), label="body") if method not in (
            "GET", "HEAD") or data.draw(st.booleans()) else None
        check_exchange(http, method, path, body, _headers(data.draw(CONTENT_TYPES)),
                       data.draw(QUERIES, label="query"))

    fuzz()


# ----------------------------------------------------------------- regressions

# (method, path, JSON body or raw bytes, query): each a defect the fuzzer found, fixed.
REGRESSIONS: list[tuple[str, str, Any, dict[str, str] | None]] = [
    # RecursionError from json.loads sniffing the body's shape: 500.
    ("POST", "/tokenize", b"[" * 100_000, None),
    # FastAPI's 422 {"detail": [...]} for a query parameter that is not a number.
    ("GET", "/health_generate", None, {"timeout": ""}),
    # A timeout that cannot be met is the client's error, not a 503 "unhealthy".
    ("GET", "/health_generate", None, {"timeout": "-1"}),
    ("GET", "/health_generate", None, {"timeout": "nan"}),
    # Ints past 64 bits passed validation, then failed to serialize for the engine: 500.
    ("POST", "/v1/completions", {"prompt": " ", "top_k": 2**64}, None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "min_tokens": -(2**63) - 1}, None),
    # Penalties and temperatures past float32 made the sampler's logits NaN: garbage text,
    # or a 500 where a grammar rejected the garbage token.
    ("POST", "/v1/chat/completions", {"messages": [{"role": "", "": None}],
                                      "guided_choice": [""],
                                      "repetition_penalty": 9.599893563794621e-61}, None),
    ("POST", "/v1/completions", {"prompt": "a", "guided_choice": ["ab"],
                                 "temperature": 1e300}, None),
    # A template from chat_template_kwargs replaced the model's; its ZeroDivisionError
    # was a 500 (and uvicorn closed the connection after it).
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}},
     None),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "a"}],
                           "chat_template": "{{ 1/0 }}"}, None),
    # A body that is not UTF-8 reached json.loads on the Messages route: 500.
    ("POST", "/v1/messages", b"\x80", None),
    ("POST", "/v1/messages/count_tokens", b"\x80", None),
]


@pytest.mark.parametrize("method, path, body, params", REGRESSIONS)
def test_fuzz_regressions(http, method, path, body, params):
    raw = body if isinstance(body, bytes) or body is None else encode(body)
    assert check_exchange(http, method, path, raw, params=params) == 400
