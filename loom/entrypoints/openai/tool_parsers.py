"""Tool-call parsers for ``tool_choice: "auto"``, chosen by ``--tool-call-parser``.

``hermes`` (Hermes 2 Pro, Qwen 2.5/3 and others): the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's ``content``. Streaming sends content deltas
until ``<tool_call>``, then per call a delta with its id and name and deltas of its
arguments' JSON text, which join into exactly the arguments of the finished call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from loom.entrypoints.openai.text_split import MarkerScanner


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def arguments_json(arguments: Any) -> str:
    """Arguments as JSON text; a string that already holds JSON passes through."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


class HermesToolParser:
    START = "<tool_call>"
    END = "</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a complete output. A malformed call stays in content."""
        content_parts, calls = [], []
        position = 0
        while True:
            start = text.find(self.START, position)
            if start < 0:
                content_parts.append(text[position:])
                break
            end = text.find(self.END, start)
            body_end = end if end >= 0 else len(text)
            call = _parse_call(text[start + len(self.START):body_end])
            if call is None:
                content_parts.append(text[position:body_end + (len(self.END) if end >= 0 else 0)])
            else:
                content_parts.append(text[position:start])
                calls.append(call)
            if end < 0:
                break
            position = end + len(self.END)
        content = "".join(content_parts)
        if calls:
            content = content.strip()
        return content or None, calls

    def streaming(self) -> HermesStreamingParser:
        return HermesStreamingParser(self)


class HermesStreamingParser:
    """Feed output deltas; get (content delta, tool-call deltas in OpenAI's shape)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self._start = MarkerScanner(parser.START)
        self._end = MarkerScanner(parser.END)
        self._in_call = False
        self._body = ""  # the current call's text so far
        self._index = -1
        self._name_sent = False
        self._arguments_sent = 0  # characters of the arguments' text already sent
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = "", []
        while text:
            if not self._in_call:
                before, found, text = self._start.feed(text)
                content += before
                if not found:
                    break
                self._in_call, self._body, self._name_sent, self._arguments_sent = True, "", False, 0
                self._index += 1
                continue
            before, found, text = self._end.feed(text)
            self._body += before
            deltas += self._call_deltas(final=found)
            if not found:
                break
            self._in_call = False
        if self.calls and not self._in_call:
            content = content if content.strip() else ""
        return content, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._in_call:
            self._body += self._end.flush()
            return "", self._call_deltas(final=True)
        return self._start.flush(), []

    def _call_deltas(self, final: bool) -> list[dict[str, Any]]:
        deltas = []
        if not self._name_sent:
            name = _partial_name(self._body)
            if name is None and not final:
                return []
            call = _parse_call(self._body) if final else None
            name = name if name is not None else (call.name if call else None)
            if name is None:
                return []
            self.calls.append(ToolCall(name, ""))
            deltas.append({"index": self._index, "id": self.calls[-1].id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
            self._name_sent = True
        call = self.calls[-1]
        if final:
            parsed = _parse_call(self._body)
            if parsed is None:
                arguments = _raw_arguments(self._body, final=True) or "{}"
            else:
                raw = _raw_arguments(self._body, final=True)
                arguments = raw if raw is not None and _is_json(raw) else parsed.arguments
        else:
            arguments = _raw_arguments(self._body, final=False) or ""
        if final and not arguments.startswith(call.arguments):
            arguments = call.arguments  # cannot un-send; keep what was streamed (rare)
        new = arguments[self._arguments_sent:]
        if new:
            deltas.append({"index": self._index, "function": {"arguments": new}})
            call.arguments += new
            self._arguments_sent = len(arguments)
        return deltas


def _parse_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], arguments_json(arguments))


def _partial_name(body: str) -> str | None:
    """The call's name once its string is complete in a partial ``{"name": "...", ...``."""
    key = body.find('"name"')
    if key < 0:
        return None
    colon = body.find(":", key + 6)
    if colon < 0:
        return None
    rest = body[colon + 1:].lstrip()
    if not rest.startswith('"'):
        return None
    decoder = json.JSONDecoder()
    try:
        name, _ = decoder.raw_decode(rest)
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) else None


def _raw_arguments(body: str, final: bool) -> str | None:
    """The arguments' JSON text as written so far, without what may close the outer object.

    While streaming, trailing ``}`` and whitespace are held back (they may close the call,
    not the arguments); at the end, the call's closing brace is cut off.
    """
    key = body.find('"arguments"')
    if key < 0:
        return None
    colon = body.find(":", key + len('"arguments"'))
    if colon < 0:
        return None
    text = body[colon + 1:].lstrip()
    if final:
        text = text.rstrip()
        if text.endswith("}"):
            text = text[:-1].rstrip()
        return text
    return text.rstrip("} \n\r\t")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSERS)}") from None
