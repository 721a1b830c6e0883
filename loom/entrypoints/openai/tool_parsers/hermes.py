"""``hermes`` (Hermes 2 Pro, Qwen 2.5/3 and others): the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's ``content``. Streaming sends content deltas
until ``<tool_call>``, then the call's deltas (``CallStream``) until ``</tool_call>``.
"""

from __future__ import annotations

from typing import Any

from loom.entrypoints.openai.text_split import MarkerScanner
from loom.entrypoints.openai.tool_parsers.call import CallStream, ToolCall, parse_call


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
            call = parse_call(text[start + len(self.START):body_end])
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
        self._call: CallStream | None = None  # inside <tool_call> when set
        self._body = ""  # the current call's text so far
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = "", []
        while text:
            if self._call is None:
                before, found, text = self._start.feed(text)
                content += before
                if not found:
                    break
                self._call, self._body = CallStream(len(self.calls)), ""
                continue
            before, found, text = self._end.feed(text)
            self._body += before
            deltas += self._call_deltas(final=found)
            if not found:
                break
            self._call = None
        if self.calls and self._call is None:
            content = content if content.strip() else ""
        return content, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._call is not None:
            self._body += self._end.flush()
            return "", self._call_deltas(final=True)
        return self._start.flush(), []

    def _call_deltas(self, final: bool) -> list[dict[str, Any]]:
        named = self._call.call is not None
        deltas = self._call.update(self._body, final)
        if not named and self._call.call is not None:
            self.calls.append(self._call.call)
        return deltas
