"""Reasoning and tool-call parsers (hermes, llama3_json, mistral) on crafted text, whole and
streamed in awkward pieces."""

from __future__ import annotations

import json

import pytest

from loom.entrypoints.openai.chat_output import ChatOutputBuilder
from loom.entrypoints.openai.protocol import ChatCompletionRequest
from loom.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from loom.entrypoints.openai.errors import OpenAIError
from loom.entrypoints.openai.structured_outputs import (RequiredToolCallStreamer,
                                                        check_tool_choice,
                                                        parse_required_tool_calls,
                                                        request_structured_outputs,
                                                        required_tool_calls_schema)
from loom.entrypoints.openai.tool_parsers import get_tool_parser


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def splits(text: str):
    """Every way to cut the text in two, plus fixed-size pieces of 1, 2, 3 and 7."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for size in (1, 2, 3, 7):
        yield pieces(text, size)


# ----------------------------------------------------------------- reasoning

@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", "<think>step one\nstep two</think>\n\nThe answer is 4.",
     ("step one\nstep two", "\n\nThe answer is 4.")),
    ("qwen3", "Just an answer.", (None, "Just an answer.")),
    ("qwen3", "<think>cut off before the end", ("cut off before the end", None)),
    ("qwen3", "\n<think>x</think>y", ("x", "y")),
    ("qwen3", "a < b and <thinking> is not a tag", (None, "a < b and <thinking> is not a tag")),
    ("deepseek_r1", "reasoning without a start tag</think>answer", ("reasoning without a start tag",
                                                                   "answer")),
    ("deepseek_r1", "<think>tagged</think>answer", ("tagged", "answer")),
    ("deepseek_r1", "never finished thinking", ("never finished thinking", None)),
    ("deepseek_r1", "a </thin k> b </think>", ("a </thin k> b ", None)),
    ("ernie_x1", "Paris is the capital.\n</think>\n\n<response>\nParis.\n</response>",
     ("Paris is the capital.\n", "Paris.")),
    ("ernie_x1", "x</think>\n<response>\nline one\n\nline <b>two</b>\n</response>\n",
     ("x", "line one\n\nline <b>two</b>")),
    ("ernie_x1", "short</think>an answer without its wrapper", ("short",
                                                               "an answer without its wrapper")),
    ("ernie_x1", "cut off while thinking", ("cut off while thinking", None)),
    ("ernie-45-vl", "looking at the image</think>\n\nA cat.", ("looking at the image",
                                                                "\n\nA cat.")),
])
def test_reasoning_parsers_whole_and_streamed(name, text, expected):
    parser = get_reasoning_parser(name)
    assert parser.extract(text) == expected
    for deltas in splits(text):
        splitter = parser.streaming()
        reasoning = content = ""
        for delta in deltas:
            r, c = splitter.feed(delta)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == expected, deltas


def test_tags_split_across_deltas_never_leak():
    splitter = get_reasoning_parser("qwen3").streaming()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>plan") == ("plan", "")
    assert splitter.feed(" more</th") == (" more", "")
    assert splitter.feed("ink>done") == ("", "done")


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


# ----------------------------------------------------------------- hermes tool calls

HERMES = ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "days": 3, "opts": {"units": "C", "note": "a}b\\"c"}}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _join_tool_deltas(deltas):
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = call["id"] or delta.get("id")
        function = delta["function"]
        if "name" in function:
            call["name"] = function["name"]
        call["arguments"] += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_hermes_extracts_calls_and_content():
    content, calls = get_tool_parser("hermes").extract(HERMES)
    assert content == "I will look that up."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3,
                                              "opts": {"units": "C", "note": 'a}b"c'}}
    assert json.loads(calls[1].arguments) == {}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("chatcmpl-tool-")


def test_hermes_without_calls_or_with_a_malformed_one_is_content():
    parser = get_tool_parser("hermes")
    assert parser.extract("plain text") == ("plain text", [])
    content, calls = parser.extract("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"


def test_hermes_streamed_deltas_join_into_the_same_calls():
    _, expected = get_tool_parser("hermes").extract(HERMES)
    for deltas in splits(HERMES):
        streamer = get_tool_parser("hermes").streaming()
        content, tool_deltas = "", []
        for delta in deltas:
            c, t = streamer.feed(delta)
            content, tool_deltas = content + c, tool_deltas + t
        c, t = streamer.finish()
        content, tool_deltas = content + c, tool_deltas + t
        assert "<tool_call>" not in content and content.strip() == "I will look that up."
        calls = _join_tool_deltas(tool_deltas)
        assert [c["name"] for c in calls] == [c.name for c in expected]
        assert all(c["id"] for c in calls)
        assert [json.loads(c["arguments"]) for c in calls] == \
            [json.loads(c.arguments) for c in expected]


# ----------------------------------------------------------------- llama3_json and mistral

LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3, '
          '"opts": {"units": "C", "note": "a}b\\"c{"}}}; {"name": "get_time", "parameters": {}}')
MISTRAL = ('I will look that up. [TOOL_CALLS][{"name": "get_weather", "arguments": '
           '{"city": "Paris", "days": 3, "opts": {"units": "C", "note": "a}b\\"c{"}}}, '
           '{"name": "get_time", "arguments": {}}]')
WEATHER = {"city": "Paris", "days": 3, "opts": {"units": "C", "note": 'a}b"c{'}}


def _stream(parser_name: str, deltas: list[str]) -> tuple[str, list[dict]]:
    streamer = get_tool_parser(parser_name).streaming()
    content, tool_deltas = "", []
    for delta in deltas:
        c, t = streamer.feed(delta)
        content, tool_deltas = content + c, tool_deltas + t
    c, t = streamer.finish()
    return content + c, _join_tool_deltas(tool_deltas + t)


@pytest.mark.parametrize("name, text, content, calls", [
    ("llama3_json", LLAMA3, None, [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3_json", ' \n{"name": "get_time", "arguments": {"zone": "UTC"}}\n', None,
     [("get_time", {"zone": "UTC"})]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}', None,  # cut off
     [("get_time", {"zone": "UTC"})]),
    ("llama3_json", 'The answer is {"name": "x"}.', 'The answer is {"name": "x"}.', []),
    ("llama3_json", '{"answer": 4} is JSON', '{"answer": 4} is JSON', []),
    ("llama3_json", '<|python_tag|>search.call(q="x")', '<|python_tag|>search.call(q="x")', []),
    ("llama3_json", "<|pyth", "<|pyth", []),
    ("llama3_json", '{"name": "get_time", "parameters": {}} then text',
     "then text", [("get_time", {})]),
    ("mistral", MISTRAL, "I will look that up.", [("get_weather", WEATHER), ("get_time", {})]),
    ("mistral", "Plain text, [TOOL_CALL not the token", "Plain text, [TOOL_CALL not the token", []),
    ("mistral", "[TOOL_CALLS] not JSON", "[TOOL_CALLS] not JSON", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
])
def test_json_tool_parsers_whole_and_streamed(name, text, content, calls):
    got_content, got_calls = get_tool_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    for deltas in splits(text):
        streamed_content, streamed = _stream(name, deltas)
        assert (streamed_content.strip() if calls else streamed_content) == (content or ""), deltas
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls, deltas
        assert all(c["id"] for c in streamed)


def test_json_tool_parsers_stream_arguments_before_the_call_ends():
    streamer = get_tool_parser("llama3_json").streaming()
    assert streamer.feed('<|python_tag|>{"name": "get_wea') == ("", [])
    content, deltas = streamer.feed('ther", "parameters": {"city": "Pa')
    assert content == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["function"]["arguments"] == '{"city": "Pa'
    _, deltas = streamer.feed('ris"}}')
    assert deltas == [{"index": 0, "function": {"arguments": 'ris"}'}}]


def test_mistral_tool_call_ids_are_nine_alphanumerics():
    # Mistral's chat templates reject other ids when the calls come back as history.
    _, calls = get_tool_parser("mistral").extract(MISTRAL)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_unknown_tool_parser_and_serve_flag():
    from loom.cli import build_parser

    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose one of hermes"):
        get_tool_parser("nope")
    for name in ("hermes", "llama3_json", "mistral"):
        args = build_parser().parse_args(["serve", "--tool-call-parser", name])
        assert args.tool_call_parser == name


# ----------------------------------------------------------------- tool choice

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


def _chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_checks_follow_vllm():
    assert check_tool_choice(_chat_request(), False, None) == "none"
    assert check_tool_choice(_chat_request(tools=TOOLS, tool_choice="required"), False,
                             None) == "required"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(_chat_request(tools=TOOLS, tool_choice=named), False, None) == "named"
    assert check_tool_choice(_chat_request(tools=TOOLS), True, "hermes") == "auto"
    for request, message in [
        (_chat_request(tools=TOOLS, tool_choice={"type": "function",
                                                 "function": {"name": "missing"}}), "not in tools"),
        (_chat_request(tool_choice="required"), "needs tools"),
        (_chat_request(tools=TOOLS), "--enable-auto-tool-choice"),
        (_chat_request(tools=TOOLS, tool_choice="auto"), "--enable-auto-tool-choice"),
    ]:
        with pytest.raises(OpenAIError, match=message) as info:
            check_tool_choice(request, False, None)
        assert info.value.status_code == 400 and info.value.param == "tool_choice"


def test_required_schema_parse_and_stream():
    schema = required_tool_calls_schema(_chat_request(tools=TOOLS, tool_choice="required"))
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_weather", "parameters": {"city": "a]}\\"b"}}, ' \
           '{"name": "get_time", "parameters": {}}]'
    calls = parse_required_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": 'a]}"b'}), ("get_time", {})]
    for deltas in splits(text):
        streamer = RequiredToolCallStreamer()
        tool_deltas = [d for delta in deltas for d in streamer.feed(delta)]
        joined = _join_tool_deltas(tool_deltas)
        assert [(c["name"], json.loads(c["arguments"])) for c in joined] == \
            [(c.name, json.loads(c.arguments)) for c in calls]


def test_a_required_reply_cut_short_keeps_its_complete_calls_whole_and_streamed():
    """max_tokens ends the array mid-item: the whole reply and the stream both give every
    complete call (before, the whole reply's JSON did not parse and gave none), and the
    finish_reason stays "length"."""
    builder = ChatOutputBuilder("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, ' \
           '{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_wea'
    message, finish_reason = builder.message(text, "length")
    assert finish_reason == "length" and message["content"] == ""
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message["tool_calls"]]
    assert whole == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    for deltas in splits(text):
        streamer = builder.streaming()
        tool_deltas = [d for i, delta in enumerate(deltas)
                       for part in streamer.feed(delta, i == len(deltas) - 1)
                       for d in part.get("tool_calls", [])]
        joined = _join_tool_deltas(tool_deltas)
        assert [(c["name"], json.loads(c["arguments"])) for c in joined] == whole
        assert streamer.finish_reason("length") == "length"


def test_chat_output_builder_combines_reasoning_and_tool_calls():
    builder = ChatOutputBuilder("auto", None, get_tool_parser("hermes"),
                                get_reasoning_parser("deepseek_r1"))
    text = 'think first</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message, finish_reason = builder.message(text, "stop")
    assert message["reasoning_content"] == "think first" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert finish_reason == "tool_calls"
    for deltas in splits(text):
        streamer = builder.streaming()
        out = [d for i, delta in enumerate(deltas)
               for d in streamer.feed(delta, i == len(deltas) - 1)]
        reasoning = "".join(d.get("reasoning_content", "") for d in out)
        calls = _join_tool_deltas([t for d in out for t in d.get("tool_calls", [])])
        assert reasoning == "think first" and [c["name"] for c in calls] == ["get_time"]
        assert streamer.finish_reason("stop") == "tool_calls"


def test_request_structured_outputs_from_fields():
    assert request_structured_outputs(_chat_request()) is None
    assert request_structured_outputs(
        _chat_request(response_format={"type": "json_object"})).json_object
    params = request_structured_outputs(_chat_request(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object"}}}))
    assert params.json == {"type": "object"}
    assert request_structured_outputs(_chat_request(guided_regex="a+")).regex == "a+"
    assert request_structured_outputs(_chat_request(
        structured_outputs={"choice": ["a"], "disable_any_whitespace": True})).choice == ["a"]
    assert request_structured_outputs(_chat_request(response_format={"type": "text"})) is None
    with pytest.raises(OpenAIError, match="one structured output"):
        request_structured_outputs(_chat_request(guided_regex="a", guided_choice=["a"]))
    with pytest.raises(OpenAIError, match="schema"):
        request_structured_outputs(_chat_request(response_format={"type": "json_schema"}))


# A chat template that writes tools and tool calls as ERNIE 4.5's thinking models read and
# write them: the tools as JSON in the system turn, a call as <tool_call> JSON.
ERNIE_TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>\n{{ {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% endif %}")


def test_ernie_tool_calls_round_trip_through_its_template():
    """The ernie_x1 parsers read back, whole and streamed, what the template writes for
    an assistant's tool call after its thinking (and its plain answers, unwrapped)."""
    import jinja2

    call = {"name": "get_weather", "arguments": {"city": "Beijing", "unit": "c"}}
    rendered = jinja2.Environment().from_string(ERNIE_TOOL_TEMPLATE).render(
        messages=[{"role": "assistant", "tool_calls": [{"function": call}]}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}])
    written = rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    text = "Beijing needs a lookup.\n</think>\n\n" + written
    builder = ChatOutputBuilder("auto", None, get_tool_parser("ernie_x1"),
                                get_reasoning_parser("ernie_x1"))
    message, finish_reason = builder.message(text, "stop")
    assert message["reasoning_content"] == "Beijing needs a lookup.\n"
    assert message["content"] is None and finish_reason == "tool_calls"
    function = message["tool_calls"][0]["function"]
    assert function["name"] == "get_weather" and json.loads(function["arguments"]) == \
        call["arguments"]
    for deltas in splits(text):
        streamer = builder.streaming()
        out = [d for i, delta in enumerate(deltas)
               for d in streamer.feed(delta, i == len(deltas) - 1)]
        calls = _join_tool_deltas([t for d in out for t in d.get("tool_calls", [])])
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [("get_weather", call["arguments"])], deltas
        assert not "".join(d.get("content") or "" for d in out).strip()
        assert streamer.finish_reason("stop") == "tool_calls"
