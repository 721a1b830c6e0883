"""A chat choice's generated text -> OpenAI's message (or stream deltas): reasoning split
off first (``--reasoning-parser``), then tool calls by the request's tool choice.

    named     the text is the arguments of the named function          finish_reason as is
    required  the text is a JSON array of {"name", "parameters"}        "tool_calls"
    auto      --tool-call-parser's parser finds calls in the text      "tool_calls" if any
    none      plain content
"""

from __future__ import annotations

from typing import Any

from loom.entrypoints.openai.reasoning_parsers import ReasoningParser
from loom.entrypoints.openai.structured_outputs import (RequiredToolCallStreamer,
                                                        parse_required_tool_calls)
from loom.entrypoints.openai.tool_parsers import ToolCall, ToolParser, tool_call_id


class ChatOutputBuilder:
    def __init__(self, tool_choice: str = "none", tool_name: str | None = None,
                 tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.tool_choice = tool_choice
        self.tool_name = tool_name
        self.tool_parser = tool_parser if tool_choice == "auto" else None
        self.reasoning_parser = reasoning_parser

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the choice's finish_reason) for a complete output."""
        reasoning = None
        content: str | None = text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
        calls: list[ToolCall] = []
        if self.tool_choice == "named":
            calls, content = [ToolCall(self.tool_name, content or "")], ""
        elif self.tool_choice == "required":
            calls, content = parse_required_tool_calls(content or ""), ""
        elif self.tool_parser is not None and content:
            content, calls = self.tool_parser.extract(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        message["tool_calls"] = [call.to_dict() for call in calls]
        return message, self._finish_reason(finish_reason, bool(calls))

    def streaming(self) -> ChoiceStreamer:
        return ChoiceStreamer(self)

    def _finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        if finish_reason == "stop" and called and self.tool_choice in ("required", "auto"):
            return "tool_calls"
        return finish_reason


class ChoiceStreamer:
    """One choice's text deltas -> OpenAI delta objects."""

    def __init__(self, builder: ChatOutputBuilder) -> None:
        self.builder = builder
        self._reasoning = (builder.reasoning_parser.streaming()
                           if builder.reasoning_parser is not None else None)
        self._auto = builder.tool_parser.streaming() if builder.tool_parser is not None else None
        self._required = RequiredToolCallStreamer() if builder.tool_choice == "required" else None
        self._named_started = False
        self.called = False

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for this text (none, one or a few)."""
        reasoning, content = (self._reasoning.feed(text) if self._reasoning is not None
                              else ("", text))
        if finished and self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        tool_calls: list[dict[str, Any]] = []
        choice = self.builder.tool_choice
        if choice == "named":
            if content or (finished and not self._named_started):
                if not self._named_started:
                    tool_calls.append({"index": 0, "id": tool_call_id(), "type": "function",
                                       "function": {"name": self.builder.tool_name,
                                                    "arguments": ""}})
                    self._named_started = True
                if content:
                    tool_calls.append({"index": 0, "function": {"arguments": content}})
            content = ""
        elif choice == "required":
            tool_calls = self._required.feed(content)
            content = ""
        elif self._auto is not None:
            content, tool_calls = self._auto.feed(content)
            if finished:
                more_content, more_calls = self._auto.finish()
                content, tool_calls = content + more_content, tool_calls + more_calls
        if content:
            deltas.append({"content": content})
        if tool_calls:
            self.called = True
            deltas.append({"tool_calls": tool_calls})
        return deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.builder._finish_reason(finish_reason, self.called)
