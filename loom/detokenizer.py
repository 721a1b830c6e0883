"""Streaming text out of generated token ids: incremental detokenization and stop strings.

Per generated token the engine runs

    delta = detokenizer.update([token_id])
    emit, stopped, stop_str = stop_matcher.feed(delta)

and at the end of a stream that did not stop on a stop string

    emit, stopped, stop_str = stop_matcher.feed(detokenizer.flush())
    emit += stop_matcher.flush()
"""

from __future__ import annotations

import logging
from collections import deque

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from loom.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompt tokens decoded as context before the first output token. Some decoders change a
# token's text by position (SentencePiece drops the leading space of the first token), so
# the text of new tokens is always read as decode(context + new) minus decode(context).
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
# DecodeStream is primed with the shortest prompt suffix of at least this many tokens whose
# text is whole (no U+FFFD), looking back at most _MAX_PROMPT_PRIME_TOKENS.
_MIN_PROMPT_PRIME_TOKENS = 4
_MAX_PROMPT_PRIME_TOKENS = 24
# A character is at most 4 UTF-8 bytes, so at most 3 tokens end inside one.
_MAX_UTF8_TAIL = 3
# tokenizers raises this when a decoded window stops starting with the text emitted before
# (https://github.com/vllm-project/vllm/issues/17448).
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


def make_detokenizer(tokenizer: Tokenizer, prompt_token_ids: list[int],
                     skip_special_tokens: bool = True
                     ) -> FastIncrementalDetokenizer | IncrementalDetokenizer:
    """The Rust DecodeStream where the tokenizer is a `tokenizers` one, else the Python path."""
    if isinstance(getattr(tokenizer.hf, "backend_tokenizer", None), BackendTokenizer):
        return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


class FastIncrementalDetokenizer:
    """Text deltas from `tokenizers.decoders.DecodeStream`, as vLLM's FastIncrementalDetokenizer:
    one call into Rust per token instead of two Python-level decodes of a window.

    DecodeStream keeps the same prefix/read window as IncrementalDetokenizer and returns
    None while the text ends in an incomplete character (or a token adds no text, e.g. a
    skipped special token). Beside it this class keeps the ids it has not emitted yet and
    a few emitted ones as context:

        | ... | context (emitted, last few) | pending (DecodeStream said None) |

    so that flush() can release a trailing incomplete character as U+FFFD, as a full
    decode shows it, and so that when DecodeStream gives up on a window (its "Invalid
    prefix" error) the Python path takes over from the same place.

    The stream is primed with a prompt suffix whose text is whole, so the first output
    token is decoded in context (SentencePiece keeps its leading space). For byte-level
    BPE the concatenated deltas plus flush() equal tokenizer.decode(output_ids), for any
    prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend: BackendTokenizer = tokenizer.hf.backend_tokenizer
        prime = _whole_prompt_suffix(self._backend, prompt_token_ids)
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        self._context: deque[int] = deque(prime[-_PROMPT_CONTEXT_TOKENS:],
                                          maxlen=_PROMPT_CONTEXT_TOKENS)
        self._pending: list[int] = []
        self._fallback: IncrementalDetokenizer | None = None

    def update(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (maybe "")."""
        if self._fallback is not None:
            return self._fallback.update(new_token_ids)
        deltas = []
        for position, token_id in enumerate(new_token_ids):
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception as error:  # noqa: BLE001 — tokenizers raises a bare Exception
                if not str(error).startswith(_INVALID_PREFIX_ERROR):
                    raise
                deltas.append(self._fall_back(new_token_ids[position:], error))
                break
            if text is None:
                self._pending.append(token_id)
            else:
                deltas.append(text)
                self._context.extend(self._pending)
                self._context.append(token_id)
                self._pending.clear()
        return "".join(deltas)

    def flush(self) -> str:
        """The text still held back at the end of the stream (a trailing incomplete character)."""
        if self._fallback is not None:
            return self._fallback.flush()
        if not self._pending:
            return ""
        context = list(self._context)
        text = self._decode(context + self._pending)[len(self._decode(context)):]
        self._context.extend(self._pending)
        self._pending.clear()
        return text

    def _fall_back(self, token_ids: list[int], error: Exception) -> str:
        """Continue on the Python path: the context as its prompt, the pending ids unread."""
        logger.warning("tokenizers' DecodeStream failed (%s); this sequence continues on the "
                       "Python detokenizer", error)
        self._fallback = IncrementalDetokenizer(self.tokenizer, list(self._context),
                                                self.skip_special_tokens)
        unread, self._pending = self._pending + token_ids, []
        return self._fallback.update(unread)

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def _whole_prompt_suffix(backend: BackendTokenizer, prompt_token_ids: list[int]) -> list[int]:
    """Prompt tokens to prime DecodeStream with: the shortest run of at least
    _MIN_PROMPT_PRIME_TOKENS ending at the prompt's end whose text is whole (no U+FFFD),
    looking back at most _MAX_PROMPT_PRIME_TOKENS; none if there is no such run.

    A prompt that ends inside a character (a prompt of token ids may) is primed without
    its last few tokens: an output token that completes the character then reads as a
    full decode of the output shows it (U+FFFD), and no prompt text is ever emitted.
    DecodeStream would emit a primed text that ends in U+FFFD with the next token.
    """
    for end in range(len(prompt_token_ids), max(len(prompt_token_ids) - _MAX_UTF8_TAIL, 0) - 1, -1):
        start_limit = max(end - _MAX_PROMPT_PRIME_TOKENS, 0)
        for start in range(max(end - _MIN_PROMPT_PRIME_TOKENS, 0), start_limit - 1, -1):
            suffix = prompt_token_ids[start:end]
            if _REPLACEMENT_CHAR not in backend.decode(suffix):
                return suffix
    return []


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
