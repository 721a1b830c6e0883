"""Reasoning parsers: split ``<think>…</think>`` reasoning from the answer, whole or streamed.

``--reasoning-parser`` picks one:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output is
  reasoning from its first token until ``</think>`` (a ``<think>`` the model writes
  itself is dropped); with no ``</think>`` at all, everything is reasoning.
- ``qwen3``: reasoning only when the output opens with ``<think>``; up to ``</think>``
  it is reasoning, then the answer. Output without ``<think>`` (e.g.
  ``enable_thinking: false``) is all answer.
- ``ernie_x1`` (FastDeploy's name for ERNIE 4.5's thinking models; also ``ernie-x1``):
  as ``deepseek_r1``, and the answer after ``</think>`` comes wrapped in
  ``<response>``…``</response>`` (or is a ``<tool_call>``, for the tool parser): the
  wrapper, the newlines just inside it and the whitespace before it are dropped.
- ``ernie-45-vl`` (ERNIE 4.5 VL's thinking): as ``deepseek_r1``.

``reasoning_content`` and ``content`` are ``None`` when empty, as in vLLM.
"""

from __future__ import annotations

import copy

from loom.entrypoints.openai.text_split import MarkerScanner, held_back_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """Whole-text ``extract`` and a fresh ``StreamingReasoningSplitter`` per choice."""

    starts_in_reasoning: bool  # reasoning from the first token, without <think>

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a complete output."""
        splitter = self.streaming()
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def streaming(self) -> StreamingReasoningSplitter:
        return StreamingReasoningSplitter(self.starts_in_reasoning)

    def with_thinking_closed(self) -> ReasoningParser:
        """This parser for a prompt whose template closed the thinking (enable_thinking
        false, a budget of 0): reasoning only where the output opens <think> itself."""
        if not self.starts_in_reasoning:
            return self
        closed = copy.copy(self)
        closed.starts_in_reasoning = False
        return closed


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class ErnieX1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True

    def streaming(self) -> StreamingReasoningSplitter:
        return StreamingReasoningSplitter(self.starts_in_reasoning, ResponseUnwrapper())


RESPONSE_START = "<response>"
RESPONSE_END = "</response>"
# What is dropped from the answer, longest first where one contains another.
_WRAPPER = (RESPONSE_START + "\n", "\n" + RESPONSE_END, RESPONSE_START, RESPONSE_END)


class ResponseUnwrapper:
    """The answer without ERNIE's ``<response>\n``…``\n</response>`` wrapper and the
    whitespace around it, streamed: what may be the start of a wrapper tag, and trailing
    whitespace (which may precede one, or end the answer), are held back until the next
    delta decides; whitespace before the answer's first text is dropped."""

    def __init__(self) -> None:
        self._pending = ""
        self._started = False  # the answer's first text has been let through

    def feed(self, text: str) -> str:
        text = self._pending + text
        keep = max(held_back_suffix(text, marker) for marker in _WRAPPER[:2])
        if text.endswith(RESPONSE_START):  # a newline may follow it
            keep = max(keep, len(RESPONSE_START))
        keep = max(keep, len(text) - len(text.rstrip()))
        text, self._pending = (text[:-keep], text[-keep:]) if keep else (text, "")
        return self._release(text)

    def finish(self) -> str:
        text, self._pending = self._pending, ""
        return self._release(text).rstrip()

    def _release(self, text: str) -> str:
        for marker in _WRAPPER:
            text = text.replace(marker, "")
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text


class StreamingReasoningSplitter:
    """Feed output deltas; each call returns (reasoning delta, content delta).

    States: ``start`` (deciding whether the output opens with <think>), ``reasoning``
    (until </think>), ``content``. Tags split across deltas are held back, never shown.
    """

    def __init__(self, starts_in_reasoning: bool,
                 answer: ResponseUnwrapper | None = None) -> None:
        self._state = "start"
        self._starts_in_reasoning = starts_in_reasoning
        self._start_buffer = ""
        self._end = MarkerScanner(THINK_END)
        self._answer = answer  # what the answer passes through (ERNIE's unwrapping)

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._feed(text)
        return reasoning, self._answer.feed(content) if self._answer and content else content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        reasoning, content = self._finish()
        if self._answer is None:
            return reasoning, content
        return reasoning, self._answer.feed(content) + self._answer.finish()

    def _feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state == "start":
            self._start_buffer += text
            stripped = self._start_buffer.lstrip()
            if stripped.startswith(THINK_START):
                text = stripped[len(THINK_START):]
                self._state = "reasoning"
            elif THINK_START.startswith(stripped):
                return "", ""  # only whitespace, or a prefix of <think>: wait for more
            else:
                text = self._start_buffer
                self._state = "reasoning" if self._starts_in_reasoning else "content"
            self._start_buffer = ""
        if self._state == "reasoning":
            before, found, after = self._end.feed(text)
            reasoning = before
            if not found:
                return reasoning, ""
            self._state = "content"
            text = after
        return reasoning, content + text

    def _finish(self) -> tuple[str, str]:
        if self._state == "start":
            # Only whitespace or a prefix of <think> arrived.
            text, self._start_buffer = self._start_buffer, ""
            return (text, "") if self._starts_in_reasoning else ("", text)
        if self._state == "reasoning":
            return self._end.flush(), ""
        return "", ""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "ernie_x1": ErnieX1ReasoningParser,
    "ernie-x1": ErnieX1ReasoningParser,
    "ernie-45-vl": DeepSeekR1ReasoningParser,
}


def explicit_reasoning_parser() -> ReasoningParser:
    """Reasoning only where the output opens with <think> (for grammar-constrained output)."""
    return Qwen3ReasoningParser()


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "StreamingReasoningSplitter",
           "get_reasoning_parser", "held_back_suffix"]
