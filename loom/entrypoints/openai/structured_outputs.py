"""Request fields -> ``StructuredOutputsParams``: response_format, vLLM's
``structured_outputs`` and ``guided_*`` fields, and the grammar that forces tool calls.

Tool choice, as in vLLM:

- a named function: the output is that function's arguments, constrained by its
  ``parameters`` schema;
- ``required``: the output is a JSON array of at least one ``{"name", "parameters"}``
  object, each item one of the tools (``anyOf``), so every call validates;
- ``auto``: unconstrained; ``--tool-call-parser`` finds calls in the text;
- ``none``: no calls.
"""

from __future__ import annotations

import json
from typing import Any

from loom.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from loom.entrypoints.openai.errors import RequestError
from loom.entrypoints.openai.tool_parsers import ToolCall, arguments_json
from loom.sampling_params import SamplingParamsError, StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def request_structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint the request's fields ask for, or None; a 400 for two or a bad one."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            schema = response_format.json_schema.json_schema if response_format.json_schema else None
            if schema is None:
                raise RequestError("response_format json_schema needs json_schema.schema",
                                   param="response_format")
            found.append(("response_format", {"json": schema}))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        options = {k: fields.pop(k) for k in ("disable_any_whitespace",
                                              "disable_additional_properties") if k in fields}
        if fields:
            found.append(("structured_outputs", {**fields, **options}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        raise RequestError(f"give one structured output constraint, got "
                           f"{', '.join(name for name, _ in found)}", param=found[1][0])
    param, fields = found[0]
    return make_params(fields, param)


def make_params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamsError as error:
        raise RequestError(f"{param}: {error.problem}", param=param) from None
    except (ValueError, TypeError) as error:  # msgspec's own type checks
        raise RequestError(f"{param}: {error}", param=param) from None


# ----------------------------------------------------------------- tools

def check_tool_choice(request: ChatCompletionRequest, enable_auto_tool_choice: bool,
                      tool_parser: str | None) -> str:
    """The effective tool choice ("none", "auto", "required" or "named"); 400s as vLLM."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in request.tools or []]
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names function {choice.function.name!r}, which is "
                               f"not in tools ({', '.join(names) or 'none given'})",
                               param="tool_choice")
        return "named"
    if choice in ("required", "auto") and not request.tools:
        raise RequestError(f'tool_choice "{choice}" needs tools', param="tool_choice")
    if choice == "auto" and not (enable_auto_tool_choice and tool_parser):
        raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", param="tool_choice")
    return choice


def tool_choice_structured_outputs(request: ChatCompletionRequest,
                                   tool_choice: str) -> StructuredOutputsParams | None:
    if tool_choice == "named":
        name = request.tool_choice.function.name
        tool = next(t for t in request.tools if t.function.name == name)
        return make_params({"json": tool.function.parameters or _ANY_OBJECT}, "tools")
    if tool_choice == "required":
        return make_params({"json": required_tool_calls_schema(request)}, "tools")
    return None


def required_tool_calls_schema(request: ChatCompletionRequest) -> dict[str, Any]:
    """A JSON array of one or more calls, each of one of the tools (vLLM's shape)."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": tool.function.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for tool in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def parse_required_tool_calls(text: str) -> list[ToolCall]:
    """The calls in a ``required`` output (a JSON array of {"name", "parameters"}): every
    complete item, as ``RequiredToolCallStreamer`` streams them, so that a reply cut
    short by max_tokens keeps the same calls whole as streamed."""
    streamer = RequiredToolCallStreamer()
    streamer.feed(text)
    return streamer.calls


class RequiredToolCallStreamer:
    """Streams a ``required`` output's calls: each one as soon as its array item closes.

    Tracks JSON nesting (strings and escapes included) over the deltas; an item is the
    text between depth 1 and back. The grammar guarantees the shape.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        for char in text:
            if self._depth >= 2:
                self._item += char
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item = char
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1:
                    deltas += self._emit(self._item)
        return deltas

    def _emit(self, item_text: str) -> list[dict[str, Any]]:
        try:
            item = json.loads(item_text)
        except json.JSONDecodeError:
            return []
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        call = ToolCall(item["name"], arguments_json(item.get("parameters", {})))
        self.calls.append(call)
        index = len(self.calls) - 1
        return [{"index": index, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": ""}},
                {"index": index, "function": {"arguments": call.arguments}}]
