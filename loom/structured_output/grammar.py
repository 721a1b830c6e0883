"""A request's ``StructuredOutputsParams`` as an llguidance grammar, and its validation.

Validation needs no tokenizer and takes well under a millisecond, so the API side runs
it before admitting a request: a malformed schema, regex or grammar is a 400 for that
request, never an error inside the engine core's step.
"""

from __future__ import annotations

import json

import llguidance

from loom.config import StructuredOutputsConfig
from loom.sampling_params import StructuredOutputsParams


# Free whitespace in JSON, bounded: an unbounded run lets a model loop on newlines forever
# (a known failure of grammar-constrained JSON); 20 still allows pretty-printing.
FREE_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


class GrammarError(ValueError):
    """The constraint cannot be compiled: a malformed or unsupported schema, regex or grammar."""


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
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be a JSON object")
            no_whitespace = _pick(params.disable_any_whitespace, config.disable_any_whitespace)
            closed = _pick(params.disable_additional_properties,
                           config.disable_additional_properties)
            if closed and isinstance(schema, dict):
                schema = _close_objects(schema)
            overrides = ({"whitespace_flexible": False} if no_whitespace
                         else {"whitespace_pattern": FREE_WHITESPACE})
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=overrides)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # GBNF/EBNF or Lark
    except GrammarError:
        raise
    except (ValueError, TypeError) as error:
        raise GrammarError(f"invalid {kind}: {error}") from None


def validate_structured_outputs(params: StructuredOutputsParams,
                                config: StructuredOutputsConfig | None = None) -> str:
    """Build and check the grammar; returns it, or raises GrammarError naming the fault."""
    grammar = build_grammar(params, config)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {params.kind}: {messages[0].strip()}")
    return grammar


def _pick(request_value: bool | None, default: bool) -> bool:
    return default if request_value is None else request_value


def _close_objects(schema):
    """``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _close_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and \
            "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
