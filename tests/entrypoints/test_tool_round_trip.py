"""Multi-turn tool use: the history an OpenAI tool loop sends back (an assistant turn with
``"content": null`` and ``tool_calls``, then ``tool`` turns with ``tool_call_id``) renders
through a Qwen2/Hermes-style chat template, in process and through a real `loom serve`
driven by the official `openai` client."""

from __future__ import annotations

import json

import openai
import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer

from loom.entrypoints.openai.protocol import RESERVED_TEMPLATE_KWARGS, ChatCompletionRequest
from loom.entrypoints.openai.serving_chat import render_chat_prompt
from loom.entrypoints.openai.errors import OpenAIError
from loom.tokenizer import Tokenizer, load_tokenizer, template_message

MODEL = "tiny"

# Qwen2.5's template in shape (tool names only, to fit the tiny model's 512 positions):
# tools in a system block, arguments through `tojson`, tool results as user turns. Like
# many templates it adds message.content to a string, which fails when content is missing.
TOOL_TEMPLATE = (  # (HF renders with trim_blocks: a newline right after a tag is dropped)
    "{% if tools %}<|im_start|>system\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool.function.name }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + message.content }}"
    "{% for tool_call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response id=\"{{ message.tool_call_id }}\">\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
TOOLS = [WEATHER]
# The tiny random model calls a tool only when a grammar makes it (Hermes format).
HERMES_CALL = ('root ::= "<tool_call>" "{\\"name\\": \\"get_weather\\", \\"arguments\\": '
               '{\\"city\\": \\"" [a-z]{1,6} "\\", \\"days\\": " [1-7] "}}" "</tool_call>"')
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
HISTORY_TEXT = (
    "<|im_start|>user\nweather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response id="call_1">\n{"temp": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_model_dir) -> Tokenizer:
    return load_tokenizer(tiny_model_dir, chat_template=TOOL_TEMPLATE)


# ----------------------------------------------------------------- in process

def test_null_content_tool_calls_and_tool_call_id_render(tool_tokenizer):
    assert tool_tokenizer.render_chat_template(HISTORY) == HISTORY_TEXT
    # The same through the server's path: the JSON body, strict validation, rendering.
    body = json.dumps({"model": MODEL, "messages": HISTORY})
    request = ChatCompletionRequest.model_validate_json(body)
    assert render_chat_prompt(tool_tokenizer, request.messages, None, True, {}) == HISTORY_TEXT


def test_missing_content_and_text_parts_render_as_strings(tool_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant"},
                {"role": "user", "content": []}]
    assert tool_tokenizer.render_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n")


@pytest.mark.parametrize("arguments, rendered", [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ({"city": "Paris"}, {"city": "Paris"}),  # already an object
    ("", {}), (None, {}),
    ("{not json", {}), ("[1, 2]", {}), ("42", {}),  # kept renderable, as vLLM does
])
def test_tool_call_arguments_become_objects(arguments, rendered):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    out = template_message(message)
    assert out["content"] == "" and out["tool_calls"][0]["function"]["arguments"] == rendered
    assert out["tool_calls"][0]["id"] == "c"
    assert message["tool_calls"][0]["function"]["arguments"] == arguments  # not modified


def test_empty_tool_calls_are_dropped():
    assert template_message({"role": "assistant", "content": "x", "tool_calls": []}) == {
        "role": "assistant", "content": "x"}


@pytest.mark.parametrize("message", [
    {"role": "assistant", "tool_calls": [{"type": "function", "function": "f"}]},
    {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]},
    {"role": "assistant", "tool_calls": {"function": {"name": "f"}}},
])
def test_malformed_tool_calls_are_bad_requests(tool_tokenizer, message):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}, message]})
    with pytest.raises(OpenAIError) as raised:
        request = ChatCompletionRequest.parse(body.encode())
        render_chat_prompt(tool_tokenizer, request.messages, None, True, {})
    assert raised.value.status_code == 400
    with pytest.raises(ValueError):
        template_message(message)


# ----------------------------------------------------------------- through the server

@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests", "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai(timeout=120.0)


def _tool_result(call) -> str:
    arguments = json.loads(call.function.arguments)
    return json.dumps({"city": arguments["city"], "temp": 21})


def _expected_prompt_tokens(tokenizer: Tokenizer, messages: list) -> int:
    plain = [m if isinstance(m, dict) else m.model_dump(exclude_unset=True) for m in messages]
    return len(tokenizer.apply_chat_template(plain, tools=TOOLS))


def test_sdk_tool_loop(client, tool_tokenizer):
    """The loop of OpenAI's function-calling guide: append the response message as is,
    answer each call with a tool turn, ask again."""
    messages: list = [{"role": "user", "content": "what is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, seed=1,
        extra_body={"guided_grammar": HERMES_CALL})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    messages.append(message)
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens == _expected_prompt_tokens(tool_tokenizer, messages)

    # The same history as most loops write it by hand: content null.
    messages[1] = {"role": "assistant", "content": None,
                   "tool_calls": [call.model_dump() for call in message.tool_calls]}
    third = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=5)
    assert third.usage.prompt_tokens == second.usage.prompt_tokens


def test_sdk_tool_loop_streaming(client, tool_tokenizer):
    messages: list = [{"role": "user", "content": "what is the weather in Paris?"}]
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, seed=2, stream=True,
            extra_body={"guided_grammar": HERMES_CALL}):
        choice = chunk.choices[0]
        finish_reason = choice.finish_reason or finish_reason
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = call["id"] or delta.id
            call["function"]["name"] += delta.function.name or ""
            call["function"]["arguments"] += delta.function.arguments or ""
    assert finish_reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    arguments = json.loads(call["function"]["arguments"])
    messages.append({"role": "tool", "tool_call_id": call["id"],
                     "content": json.dumps({"city": arguments["city"], "temp": 21})})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == _expected_prompt_tokens(tool_tokenizer, messages)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_text_parts_and_missing_content_through_the_server(client, tool_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant"},
                {"role": "user", "content": "again"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert response.usage.prompt_tokens == len(tool_tokenizer.apply_chat_template(messages))


def test_template_kwargs_cannot_override_apply_chat_templates_arguments(tool_tokenizer):
    """Every argument of transformers' apply_chat_template but the two a template may
    read (documents, continue_final_message) is reserved, in this transformers too."""
    import inspect

    arguments = set(inspect.signature(tool_tokenizer.hf.apply_chat_template).parameters)
    assert arguments - {"kwargs", "documents", "continue_final_message"} <= (
        RESERVED_TEMPLATE_KWARGS)
    for key in ("chat_template", "tokenize", "messages"):
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                           "chat_template_kwargs": {key: "{{ 1/0 }}"}})
        with pytest.raises(OpenAIError, match=f"'{key}' cannot be set") as raised:
            ChatCompletionRequest.parse(body.encode())
        assert raised.value.param == "chat_template_kwargs"


def test_any_template_error_is_a_bad_request(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir, chat_template="{{ (messages | length) / 0 }}")
    request = ChatCompletionRequest.parse(b'{"messages": [{"role": "user", "content": "1"}]}')
    with pytest.raises(OpenAIError, match="ZeroDivisionError") as raised:
        render_chat_prompt(tokenizer, request.messages, None, True, {})
    assert raised.value.status_code == 400 and raised.value.param == "messages"
