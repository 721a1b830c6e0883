"""Reasoning parsers: split ``<think>…</think>`` reasoning from the answer, whole or streamed.

``--reasoning-parser`` picks one:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output is
  reasoning from its first token until ``</think>`` (a ``<think>`` the model writes
  itself is dropped); with no ``</think>`` at all, everything is reasoning.
- ``qwen3``: reasoning only when the output opens with ``<think>``; up to ``</think>``
  it is reasoning, then the answer. Output without ``<think>`` (e.g.
  ``enable_thinking: false``) is all answer.

``reasoning_content`` and ``content`` are ``None`` when empty, as in vLLM.
"""

from __future__ import annotations

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


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class StreamingReasoningSplitter:
    """Feed output deltas; each call returns (reasoning delta, content delta).

    States: ``start`` (deciding whether the output opens with <think>), ``reasoning``
    (until </think>), ``content``. Tags split across deltas are held back, never shown.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "start"
        self._starts_in_reasoning = starts_in_reasoning
        self._start_buffer = ""
        self._end = MarkerScanner(THINK_END)

    def feed(self, text: str) -> tuple[str, str]:
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

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
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
