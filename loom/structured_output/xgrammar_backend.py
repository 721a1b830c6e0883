"""The xgrammar backend: a request's constraint as an xgrammar ``Grammar``, checked
without a tokenizer (the API side, with ``--structured-outputs-backend xgrammar``),
compiled against the tokenizer and matched token by token (the engine core).

    xgrammar_grammar()    spec -> xgr.Grammar (JSON schema, regex, choice, GBNF), GrammarError
    validate_xgrammar()   that, after refusing what xgrammar would not enforce (constraint.py)
    XgrammarBackend       the tokenizer's TokenizerInfo and a compiler: compile() -> a
                          CompiledGrammar (cached by the manager), matcher() -> XgrammarMatcher
    XgrammarMatcher       accept a token, tell termination, fill a bitmask row

The same options mean the same output as with llguidance (grammar.py): free JSON
whitespace bounded to 20 characters, none with ``disable_any_whitespace`` (``,`` and
``:`` alone), objects open unless the schema or ``disable_additional_properties`` closes
them (xgrammar's ``strict_mode`` off), special tokens never text, a length-bounded JSON
string made of JSON's characters (xgrammar 0.2 lets control characters in raw there), and
a request ends at the token after which the grammar allows only a stop token.

xgrammar imports torch (and transformers) at import: only a process that may hold torch
imports this module (loom/torch_free.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import xgrammar as xgr

from loom.config import StructuredOutputsConfig
from loom.sampling_params import StructuredOutputsParams
from loom.structured_output.constraint import (MAX_FREE_WHITESPACE, GrammarError, json_schema,
                                               no_free_whitespace, xgrammar_unsupported)
from loom.structured_output.token_table import special_token_ids, token_bytes

# xgrammar's errors open with its log prefix: "[06:47:30] /project/cpp/x.cc:820: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_grammar(params: StructuredOutputsParams,
                     config: StructuredOutputsConfig) -> xgr.Grammar:
    """``params`` as an xgrammar Grammar; GrammarError naming the fault if malformed."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = json.dumps(json_schema(params, config))
            if no_free_whitespace(params, config):
                whitespace = {"any_whitespace": False, "separators": (",", ":")}
            else:
                whitespace = {"any_whitespace": True, "max_whitespace_cnt": MAX_FREE_WHITESPACE}
            return _json_string_characters(
                xgr.Grammar.from_json_schema(schema, strict_mode=False, **whitespace))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as error:
        raise GrammarError(f"invalid {kind}: {error_message(error)}") from None


# xgrammar 0.2 writes a string with minLength or maxLength as characters of this class:
# control characters raw (which is not JSON) and no escapes. JSON's are these instead.
_BOUNDED_STRING_CHARACTER = r'(([^\"\\\r\n]))'
_JSON_STRING_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" basic_escape))'


def _json_string_characters(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` with JSON's string characters where xgrammar writes its own for a
    length-bounded string (a control character is then never output raw, and an escape
    counts as one character, as in llguidance)."""
    text = str(grammar)
    if _BOUNDED_STRING_CHARACTER not in text or "\nbasic_escape ::=" not in "\n" + text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def validate_xgrammar(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """GrammarError if xgrammar cannot serve ``params`` faithfully or cannot read it."""
    unsupported = xgrammar_unsupported(params, config)
    if unsupported is not None:
        raise GrammarError(f"xgrammar does not support {unsupported}; use "
                           "--structured-outputs-backend guidance (or auto) for it")
    xgrammar_grammar(params, config)


def choice_grammar(choices: list[str]) -> str:
    """One of ``choices`` exactly, as GBNF: ``root ::= "yes" | "no"`` (JSON's string
    escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def error_message(error: Exception) -> str:
    """xgrammar's error without its log prefix, on one line."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[-1] if lines else type(error).__name__).strip()


def tokenizer_info(hf: Any, vocab_size: int, eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of ``hf`` (a fast Hugging Face tokenizer) over the model's
    ``vocab_size`` ids, read as llguidance reads it (grammar.py, token_table.py): each
    token's bytes, special tokens none (xgrammar would take "<|im_start|>" for text,
    inside a JSON string too; without bytes it never allows them, as llguidance does
    not), the eos ids as stop tokens.

    The bytes are xgrammar's own reading of a byte-level or byte-fallback vocabulary;
    one it would read raw (SentencePiece's Metaspace decoder: "▁hello" would stay
    "▁hello") gets loom's table from the tokenizer's own decoding instead.
    """
    stop = [i for i in eos_token_ids if i < vocab_size] or None
    read = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    special = special_token_ids(hf)
    if read.vocab_type == xgr.VocabType.RAW:
        tokens = token_bytes(hf, max(vocab_size, len(hf)), special)[:vocab_size]
    else:
        tokens = list(read.decoded_vocab)
    tokens = [b"" if token_id in special else token for token_id, token in enumerate(tokens)]
    return xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop)


class XgrammarBackend:
    """Compiles constraints for one tokenizer (loom's ``Tokenizer``) and model vocabulary."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        self.config = config
        info = tokenizer_info(tokenizer.hf, vocab_size, sorted(tokenizer.eos_token_ids))
        self._stop_token_ids = list(info.stop_token_ids)
        self._words = (vocab_size + 31) // 32
        # One thread: the engine core's compile thread beside the workers' (the manager
        # caches compiled grammars itself).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = xgrammar_grammar(params, self.config)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            raise GrammarError(f"invalid {params.kind}: {error_message(error)}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(compiled, self._stop_token_ids, self._words)


class XgrammarMatcher:
    """One request's position in its grammar.

    llguidance stops a matcher as soon as its grammar allows nothing but a stop token;
    xgrammar waits for that token. So that a request ends at the same token with either,
    a complete matcher whose next mask allows only stop tokens counts as terminated (that
    mask, computed to tell, is kept for the next fill).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int],
                 words: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._next = np.empty((1, words), dtype=np.int32)  # the next mask, once computed
        self._next_is_filled = False
        self._not_stop = np.full(words, -1, dtype=np.int32)  # every bit but the stop tokens'
        for token_id in stop_token_ids:
            self._not_stop.view(np.uint32)[token_id // 32] &= ~np.uint32(1 << (token_id % 32))

    def accept_token(self, token_id: int) -> bool:
        self._next_is_filled = False
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        if self._matcher.is_terminated():  # it accepted a stop token
            return True
        if not self._matcher.is_completed():
            return False
        return not (self._next_mask() & self._not_stop).any()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask`` (int32 words, ceil(V / 32) per row): the tokens the
        grammar allows next."""
        if self._next_is_filled:
            bitmask[row] = self._next[0]
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def error(self) -> str:
        return ""  # xgrammar says only that it rejected the token

    def _next_mask(self) -> np.ndarray:
        if not self._next_is_filled:
            self._matcher.fill_next_token_bitmask(self._next, 0)
            self._next_is_filled = True
        return self._next[0]
