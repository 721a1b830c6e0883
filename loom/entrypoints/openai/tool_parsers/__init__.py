"""Tool-call parsers for ``tool_choice: "auto"``, chosen by ``--tool-call-parser``.

    hermes       <tool_call>{"name": ..., "arguments": ...}</tool_call>   (hermes.py)
    ernie_x1     the same, as ERNIE 4.5's thinking models write it        (hermes.py)
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": ...}; {...}   (json_calls.py)
    mistral      content[TOOL_CALLS][{"name": ..., "arguments": ...}]      (json_calls.py)

A parser's ``extract(text)`` gives (content, calls) of a complete output; its
``streaming()`` gives a streamer to ``feed`` output deltas and ``finish``, each returning
(content delta, tool-call deltas in OpenAI's shape): per call one delta with its index,
id and name, then deltas of its arguments' JSON text, which join into exactly the
arguments of the finished call.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from loom.entrypoints.openai.tool_parsers.call import ToolCall, arguments_json, tool_call_id

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStreamer", "ToolParser", "arguments_json",
           "get_tool_parser", "tool_call_id"]


class ToolCallStreamer(Protocol):
    calls: list[ToolCall]  # the calls named so far, arguments as streamed

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...


class ToolParser(Protocol):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]: ...

    def streaming(self) -> ToolCallStreamer: ...


# name -> (module in this package, class)
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "HermesToolParser"),
    "ernie_x1": ("hermes", "HermesToolParser"),
    "ernie-x1": ("hermes", "HermesToolParser"),
    "llama3_json": ("json_calls", "Llama3JsonToolParser"),
    "mistral": ("json_calls", "MistralToolParser"),
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        module_name, class_name = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSERS)}") from None
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)()
