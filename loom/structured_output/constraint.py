"""A request's constraint as every backend reads it, and which backend serves it.

    backend_for(params, config)      "guidance" or "xgrammar" (--structured-outputs-backend;
                                     auto: xgrammar unless the request needs what it does
                                     not enforce, then guidance, as vLLM's auto)
    xgrammar_unsupported(params)     why xgrammar cannot serve it faithfully, or None
    json_schema(params, config)      the schema both backends compile, with the engine's
                                     and the request's options applied

Nothing here imports llguidance, xgrammar or torch: the API process (which imports no
torch, loom/torch_free.py) decides with it.
"""

from __future__ import annotations

import json
from typing import Any

from loom.config import StructuredOutputsConfig
from loom.sampling_params import StructuredOutputsParams

# Free whitespace in JSON, bounded: an unbounded run lets a model loop on newlines forever
# (a known failure of grammar-constrained JSON); 20 still allows pretty-printing.
MAX_FREE_WHITESPACE = 20


class GrammarError(ValueError):
    """The constraint cannot be compiled: a malformed or unsupported schema, regex or grammar."""


def backend_for(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    """The backend that serves ``params``: ``guidance`` (llguidance) or ``xgrammar``."""
    if config.backend == "xgrammar":
        return "xgrammar"
    if config.backend == "auto" and xgrammar_unsupported(params, config) is None:
        return "xgrammar"
    return "guidance"


def no_free_whitespace(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> bool:
    """JSON without free whitespace: the request's ``disable_any_whitespace``, else the
    engine's (``--structured-outputs-disable-any-whitespace``)."""
    return _pick(params.disable_any_whitespace, config.disable_any_whitespace)


def json_schema(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> dict | bool:
    """The request's JSON schema (``{"type": "object"}`` for ``json_object``), its objects
    closed where ``disable_additional_properties`` says so; GrammarError if it is not one."""
    schema = params.json if params.kind == "json" else {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be a JSON object")
    closed = _pick(params.disable_additional_properties, config.disable_additional_properties)
    return _close_objects(schema) if closed and isinstance(schema, dict) else schema


def is_lark(grammar: str) -> bool:
    """Lark (``start: ...``) rather than GBNF/EBNF (``root ::= ...``): GBNF defines every
    rule with ``::=``, Lark never does."""
    return "::=" not in grammar


# ----------------------------------------------------------------- what xgrammar lacks

# JSON schema keywords xgrammar 0.2 accepts and does not enforce (output may break them;
# tests/structured_output/test_xgrammar.py holds xgrammar to this list).
XGRAMMAR_IGNORED_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains",
    "maxContains", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties"})
# The string formats xgrammar turns into a grammar; others it ignores.
XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords whose value is a schema, a list of schemas, or a name -> schema mapping.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedItems",
              "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def xgrammar_unsupported(params: StructuredOutputsParams,
                         config: StructuredOutputsConfig) -> str | None:
    """What in ``params`` xgrammar would not enforce or does not read, in words; None if
    it serves ``params`` as llguidance would.

    JSON schemas: the keywords it ignores, formats it does not know, ``pattern`` or
    ``format`` with a length bound (it drops the bound), ``multipleOf`` on numbers that
    are not integers, ``patternProperties`` beside ``properties``, a ``$ref`` outside the
    schema. Grammars: Lark (llguidance reads it with its lexer; xgrammar converts it).
    Regexes: POSIX classes (``[[:alpha:]]``), which it misreads. What it cannot parse
    at all (lookarounds, ``\\p{..}``, llguidance's GBNF extensions) is its compile error.
    """
    kind = params.kind
    if kind == "grammar" and is_lark(params.grammar):
        return "Lark grammars (it reads GBNF: rule ::= ...)"
    if kind == "regex" and "[[:" in params.regex:
        return "POSIX character classes ([[:alpha:]]) in a regex"
    if kind in ("json", "json_object"):
        try:
            schema = json_schema(params, config)
        except GrammarError:
            return None  # malformed: each backend's validation says so
        return _unsupported_in_schema(schema, "#")
    return None


def _unsupported_in_schema(schema: Any, path: str) -> str | None:
    if not isinstance(schema, dict):
        return None
    ignored = sorted(XGRAMMAR_IGNORED_KEYWORDS & schema.keys())
    if ignored:
        return f"the JSON schema keyword {ignored[0]!r} (at {path})"
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types or [])
    if "format" in schema and schema["format"] not in XGRAMMAR_FORMATS and \
            (not types or "string" in types):
        return f"the string format {schema['format']!r} (at {path})"
    if ("pattern" in schema or "format" in schema) and \
            ("minLength" in schema or "maxLength" in schema):
        return f"a length bound beside a pattern or format (at {path})"
    step = schema.get("multipleOf")
    if step is not None and (types != {"integer"} or not isinstance(step, (int, float))
                             or not float(step).is_integer()):
        return f"multipleOf on numbers that are not integers (at {path})"
    if "patternProperties" in schema and "properties" in schema:
        return f"patternProperties beside properties (at {path})"
    if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#"):
        return f"a $ref outside the schema ({schema['$ref']!r} at {path})"
    for keyword in _SUBSCHEMA:
        value = schema.get(keyword)
        items = value if isinstance(value, list) else [value]  # items as a list (draft 4)
        for index, item in enumerate(items):
            found = _unsupported_in_schema(item, f"{path}/{keyword}" +
                                           (f"/{index}" if isinstance(value, list) else ""))
            if found:
                return found
    for keyword in _SUBSCHEMA_LISTS:
        for index, item in enumerate(schema.get(keyword) or []):
            found = _unsupported_in_schema(item, f"{path}/{keyword}/{index}")
            if found:
                return found
    for keyword in _SUBSCHEMA_MAPS:
        value = schema.get(keyword)
        for name, item in (value.items() if isinstance(value, dict) else ()):
            found = _unsupported_in_schema(item, f"{path}/{keyword}/{name}")
            if found:
                return found
    return None


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
