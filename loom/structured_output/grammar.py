"""The API side's check of a request's constraint, and the llguidance backend.

``validate_structured_outputs`` runs before a request is admitted, so that a malformed
schema, regex or grammar is a 400 for that request, never an error inside the engine
core's step. It checks with the backend that will serve the request: llguidance for
``auto``, ``guidance`` and ``llguidance`` (well under a millisecond, no tokenizer, no
torch), xgrammar for ``xgrammar`` (xgrammar_backend.py; it imports torch, so that
server's API process holds torch). With ``auto`` the engine core serves what xgrammar
supports with xgrammar and falls back to llguidance where xgrammar's compile fails, so
every request llguidance accepts is served.

The llguidance backend: ``build_grammar`` (spec -> llguidance grammar text),
``GuidanceBackend`` (the tokenizer; compile -> a matcher to copy per request) and
``GuidanceMatcher``.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from loom.config import StructuredOutputsConfig
from loom.sampling_params import StructuredOutputsParams
from loom.structured_output.constraint import (MAX_FREE_WHITESPACE, GrammarError, json_schema,
                                               no_free_whitespace)
from loom.structured_output.token_table import ll_tokenizer

FREE_WHITESPACE = rf"[\x20\x0A\x0D\x09]{{0,{MAX_FREE_WHITESPACE}}}"


def validate_structured_outputs(params: StructuredOutputsParams,
                                config: StructuredOutputsConfig | None = None) -> None:
    """GrammarError naming the fault if the backend serving ``params`` cannot compile it."""
    config = config or StructuredOutputsConfig()
    if config.backend == "xgrammar":
        from loom.structured_output.xgrammar_backend import validate_xgrammar

        validate_xgrammar(params, config)
        return
    grammar = build_grammar(params, config)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {params.kind}: {messages[0].strip()}")


def load_xgrammar() -> None:
    """Import xgrammar (and torch with it: seconds) ahead of the first request it checks;
    a ValueError naming the flag if it cannot be imported here."""
    try:
        importlib.import_module("loom.structured_output.xgrammar_backend")
    except ImportError as error:
        raise ValueError(f"--structured-outputs-backend xgrammar needs the xgrammar package "
                         f"({error}); install it, or use --structured-outputs-backend "
                         "guidance") from None


def build_grammar(params: StructuredOutputsParams,
                  config: StructuredOutputsConfig | None = None) -> str:
    """The llguidance grammar text (its JSON form) for ``params``; GrammarError if malformed.

    Per-request ``disable_any_whitespace`` / ``disable_additional_properties`` override
    the engine's defaults in ``config``.
    """
    config = config or StructuredOutputsConfig()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            overrides = ({"whitespace_flexible": False} if no_free_whitespace(params, config)
                         else {"whitespace_pattern": FREE_WHITESPACE})
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(json_schema(params, config)), overrides=overrides)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # GBNF/EBNF or Lark
    except GrammarError:
        raise
    except (ValueError, TypeError) as error:
        raise GrammarError(f"invalid {kind}: {error}") from None


class GuidanceBackend:
    """Compiles constraints for one tokenizer (loom's ``Tokenizer``) and model vocabulary."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        self.config = config
        self._tokenizer = ll_tokenizer(tokenizer.hf, max(vocab_size, len(tokenizer.hf)),
                                       sorted(tokenizer.eos_token_ids))

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, for ``matcher`` to copy."""
        template = llguidance.LLMatcher(self._tokenizer, build_grammar(params, self.config),
                                        log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {params.kind}: {template.get_error().strip()}")
        return template

    def matcher(self, template: llguidance.LLMatcher) -> GuidanceMatcher:
        return GuidanceMatcher(template.deep_copy())


class GuidanceMatcher:
    """One request's position in its grammar (an llguidance matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar allows nothing more (or a stop token was accepted)."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def error(self) -> str:
        return self._matcher.get_error()
