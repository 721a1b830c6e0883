"""Streaming text out of generated token ids: incremental detokenization and stop strings.

Per generated token the engine runs

    delta = detokenizer.update([token_id])
    emit, stopped, stop_str = stop_matcher.feed(delta)

and at the end of a stream that did not stop on a stop string

    emit, stopped, stop_str = stop_matcher.feed(detokenizer.flush())
    emit += stop_matcher.flush()
"""

from __future__ import annotations

from loom.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token. Some decoders change a
# token's text by position (SentencePiece drops the leading space of the first token), so
# the text of new tokens is always read as decode(context + new) minus decode(context).
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, decoding a few tokens at a time (vLLM's scheme).

    Token ids seen, of which only `_window` (from prefix_offset on) is kept:

        | ... | context (already emitted) | unread tokens |
              ^prefix_offset              ^read_offset

    Each update decodes the window and the context alone; the difference is the new text.
    While the window's text ends in U+FFFD, the last token holds only part of a multi-byte
    character (byte-level BPE splits emoji and CJK across tokens), so nothing is emitted
    and the unread tokens wait for the rest. Once text is emitted the unread tokens become
    the next context, so the window stays a few tokens long.

    For byte-level BPE the concatenated deltas plus flush() equal
    tokenizer.decode(output_ids), as long as the prompt ends on a character boundary.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context_tokens = len(self._window)  # read_offset - prefix_offset
        self._context_text: str | None = None  # decode of the context, computed when needed

    def update(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (maybe "")."""
        self._window.extend(new_token_ids)
        context_text = self._decode_context()
        window_text = self._decode(self._window)
        if len(window_text) <= len(context_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return window_text[len(context_text):]

    def flush(self) -> str:
        """The text still held back at the end of the stream (a trailing incomplete character)."""
        context_text = self._decode_context()
        window_text = self._decode(self._window)
        self._advance()
        return window_text[len(context_text):]

    def _advance(self) -> None:
        """The unread tokens have been emitted and become the context."""
        del self._window[:self._num_context_tokens]
        self._num_context_tokens = len(self._window)
        self._context_text = None

    def _decode_context(self) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._window[:self._num_context_tokens])
        return self._context_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)


def find_stop_string(text: str, num_new_chars: int, stop: list[str],
                     include_stop_str_in_output: bool = False) -> tuple[str, str] | None:
    """The first stop string completed by the last num_new_chars characters of text.

    Returns (stop string, text cut before it, or after it with include_stop_str_in_output),
    or None. Text before the new characters was searched when it arrived, so only stops
    ending among the new characters are looked for: they start at most max_stop_len - 1
    characters before them.

        text = "… the end###", new = "d###", stop = ["###"]  ->  ("###", "… the end")

    "First" means first to end, as if the text had arrived one character at a time; of
    stops ending at the same character, the longest wins.
    """
    if not stop:
        return None
    search_start = max(len(text) - num_new_chars - max(map(len, stop)) + 1, 0)
    first: tuple[int, int, str] | None = None  # (end, -length, stop string): min is first
    for stop_str in stop:
        start = text.find(stop_str, search_start)
        if start != -1:
            candidate = (start + len(stop_str), -len(stop_str), stop_str)
            first = candidate if first is None else min(first, candidate)
    if first is None:
        return None
    end, _, stop_str = first
    return stop_str, text[:end] if include_stop_str_in_output else text[:end - len(stop_str)]


class StopStringMatcher:
    """Stops streamed text at the first stop string and never streams part of one.

        | emitted | held back: a tail that a stop string begins with |

    A held-back tail is released once the following text shows it is not a stop. With
    include_stop_str_in_output nothing is held back: the stop string is emitted either way.
    `text` is the whole output text so far, cut at the stop string once stopped.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop_str: str | None = None
        self._num_emitted_chars = 0
        self._max_stop_len = max(map(len, self.stop), default=0)

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def feed(self, delta: str, check_stop: bool = True) -> tuple[str, bool, str | None]:
        """Add a text delta; return (text to stream now, stopped, stop string).

        check_stop=False (e.g. before min_tokens) accumulates and streams without matching.
        """
        if self.stopped:
            return "", True, self.stop_str
        self.text += delta
        if check_stop and self.stop:
            match = find_stop_string(self.text, len(delta), self.stop, self.include_stop_str_in_output)
            if match is not None:
                self.stop_str, self.text = match
                return self._emit_up_to(len(self.text)), True, self.stop_str
        hold = self._partial_stop_len() if check_stop and not self.include_stop_str_in_output else 0
        return self._emit_up_to(len(self.text) - hold), False, None

    def flush(self) -> str:
        """Release held-back text when the stream ends for another reason (eos, length)."""
        return self._emit_up_to(len(self.text))

    def _emit_up_to(self, end: int) -> str:
        # A held-back tail only grows by the delta, so end is rarely below what was emitted;
        # it can be when check_stop turned on after text was streamed unchecked.
        emitted = self.text[self._num_emitted_chars:end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return emitted

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of text that some stop string starts with."""
        for length in range(min(self._max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
