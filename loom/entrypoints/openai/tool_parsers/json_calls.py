"""``llama3_json`` and ``mistral``: tool calls as bare JSON objects, as vLLM's parsers read them.

    llama3_json  (Llama 3.1-3.3, 4) the whole output is the calls, optionally after
                 ``<|python_tag|>``, separated by ``;``:
                     <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
                 An output that does not begin with ``{`` (or the tag and ``{``) is content.
    mistral      (Mistral 7B Instruct v0.3, Nemo) content, then ``[TOOL_CALLS]`` and a
                 JSON array of calls:
                     Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {...}}]
                 ``[TOOL_CALLS]`` is a special token: it reaches the text only for requests
                 with ``skip_special_tokens: false``. Call ids are 9 letters and digits, the
                 form Mistral's chat templates accept when the calls come back as history.
                 The name-outside-JSON form of newer Mistral tokenizers (``[TOOL_CALLS]name
                 [ARGS]{...}``) is not read.

Once the calls start, a brace-depth scanner (aware of JSON strings) cuts the text into
top-level objects; between them only whitespace and ``; , [ ]`` may stand. Each object
streams through ``CallStream``. Text that turns out not to be calls comes back as content:
an object that closes without a ``"name"``, or other text where a call should start;
everything after it is content too. The text held back while undecided is that since the
last call with a name (the tag or marker, separators, the open object).

A whole output is parsed by streaming it in one piece, so streamed and whole outputs give
the same calls and content.
"""

from __future__ import annotations

import enum
import random
import string
from collections.abc import Callable
from typing import Any

from loom.entrypoints.openai.text_split import MarkerScanner
from loom.entrypoints.openai.tool_parsers.call import CallStream, ToolCall

SEPARATORS = frozenset(" \t\r\n;,[]")


class Mode(enum.Enum):
    BEFORE_CALLS = enum.auto()
    CALLS = enum.auto()
    CONTENT = enum.auto()  # for good: the calls are over or never were


class JsonCallsStreamer:
    """Feed output deltas; get (content delta, tool-call deltas in OpenAI's shape).

    Subclasses say where the calls begin (``_before_calls``, ``_flush_before_calls``).
    """

    def __init__(self, make_id: Callable[[], str] | None = None) -> None:
        self._make_id = make_id
        self._mode = Mode.BEFORE_CALLS
        self._withheld = ""  # since the last named call: may yet be content
        self._call: CallStream | None = None  # inside a top-level object when set
        self._body = ""
        self._depth = 0
        self._in_string = self._escaped = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if self._mode is Mode.BEFORE_CALLS:
            content, text = self._before_calls(text)
        if self._mode is Mode.CALLS:
            more, deltas = self._scan(text)
            return content + more, deltas
        if self._mode is Mode.CONTENT:
            content += text
        return content, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._mode is Mode.BEFORE_CALLS:
            return self._flush_before_calls(), []
        if self._mode is Mode.CONTENT:
            return "", []
        if self._call is not None:
            deltas = self._call_deltas(final=True)
            if self._call.call is None:
                return self._withheld + self._body, deltas
            return "", deltas
        return ("" if self.calls else self._withheld), []

    def _before_calls(self, text: str) -> tuple[str, str]:
        """(content, the rest once the calls begin); sets ``_mode`` when it knows."""
        raise NotImplementedError

    def _flush_before_calls(self) -> str:
        raise NotImplementedError

    def _scan(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        for position, char in enumerate(text):
            if self._call is None:
                if char in SEPARATORS:
                    self._withheld += char
                    continue
                if char != "{":
                    return self._give_up(text[position:]), deltas
                self._call, self._body = CallStream(len(self.calls), self._make_id), ""
            self._body += char
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{}":
                self._depth += 1 if char == "{" else -1
                if self._depth == 0:
                    deltas += self._call_deltas(final=True)
                    if self._call.call is None:
                        return self._give_up(text[position + 1:]), deltas
                    self._call = None
        if self._call is not None:
            deltas += self._call_deltas(final=False)
        return "", deltas

    def _call_deltas(self, final: bool) -> list[dict[str, Any]]:
        named = self._call.call is not None
        deltas = self._call.update(self._body, final)
        if not named and self._call.call is not None:
            self.calls.append(self._call.call)
            self._withheld = ""
        return deltas

    def _give_up(self, rest: str) -> str:
        """Not a call after all: what was held back, and everything after, is content."""
        content = self._withheld + (self._body if self._call is not None else "") + rest
        self._mode, self._withheld, self._call, self._body = Mode.CONTENT, "", None, ""
        return content


class Llama3JsonStreamer(JsonCallsStreamer):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # the output's start, until it shows whether calls begin

    def _before_calls(self, text: str) -> tuple[str, str]:
        self._held += text
        head = self._held.lstrip()
        tagged = head.startswith(self.TAG)
        body = head[len(self.TAG):].lstrip() if tagged else head
        if not body or (not tagged and self.TAG.startswith(head)):
            return "", ""  # undecided: whitespace, part of the tag, or the tag alone
        held, self._held = self._held, ""
        if not body.startswith("{"):
            self._mode = Mode.CONTENT
            return held, ""
        self._mode = Mode.CALLS
        start = len(held) - len(body)  # body is a suffix of held
        self._withheld = held[:start]  # whitespace and the tag
        return "", held[start:]

    def _flush_before_calls(self) -> str:
        held, self._held = self._held, ""
        return held


class MistralStreamer(JsonCallsStreamer):
    MARKER = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__(make_id=mistral_tool_call_id)
        self._marker = MarkerScanner(self.MARKER)

    def _before_calls(self, text: str) -> tuple[str, str]:
        before, found, rest = self._marker.feed(text)
        if found:
            self._mode, self._withheld = Mode.CALLS, self.MARKER
        return before, rest

    def _flush_before_calls(self) -> str:
        return self._marker.flush()


def mistral_tool_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class _JsonToolParser:
    streamer: type[JsonCallsStreamer]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a complete output: the streamer fed it in one piece."""
        streamer = self.streaming()
        content, _ = streamer.feed(text)
        more, _ = streamer.finish()
        content += more
        if streamer.calls:
            content = content.strip()
        return content or None, streamer.calls

    def streaming(self) -> JsonCallsStreamer:
        return self.streamer()


class Llama3JsonToolParser(_JsonToolParser):
    streamer = Llama3JsonStreamer


class MistralToolParser(_JsonToolParser):
    streamer = MistralStreamer
