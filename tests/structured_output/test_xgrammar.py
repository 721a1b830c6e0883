"""xgrammar beside llguidance: auto's choice between them, the schema features xgrammar
does not enforce (held against xgrammar itself), and the same token masks from both
backends for the same constraint, on the tiny byte-level tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgrammar as xgr

from loom.config import StructuredOutputsConfig
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.request import Request
from loom.structured_output import StructuredOutputManager, backend_for
from loom.structured_output.constraint import XGRAMMAR_IGNORED_KEYWORDS
from loom.structured_output.grammar import GuidanceBackend
from loom.structured_output.xgrammar_backend import XgrammarBackend, tokenizer_info

VOCAB = 256
AUTO = StructuredOutputsConfig(backend="auto")
PERSON = {"type": "object",
          "properties": {"n": {"type": "integer", "maximum": 999},
                         "s": {"type": "string", "maxLength": 3},
                         "e": {"enum": ["ab", "cd"]},
                         "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["n", "s", "e", "l"], "additionalProperties": False}


def P(**spec) -> StructuredOutputsParams:  # noqa: N802 — reads as the params it builds
    return StructuredOutputsParams(**spec)


# ----------------------------------------------------------------- auto's choice

@pytest.mark.parametrize("params", [
    P(json=PERSON), P(json_object=True), P(regex="[a-z]{2,6}"), P(choice=["a", "b"]),
    P(grammar='root ::= "a"+'),
    P(json={"type": "integer", "multipleOf": 5}),
    P(json={"$ref": "#/$defs/a", "$defs": {"a": {"type": "string", "format": "email"}}}),
    P(json={"type": "object", "properties": {"allOf": {"type": "string"}}}),  # a name
])
def test_auto_serves_with_xgrammar_what_it_enforces(params):
    assert backend_for(params, AUTO) == "xgrammar"


@pytest.mark.parametrize("params", [
    P(json={"type": "array", "uniqueItems": True}),
    P(json={"anyOf": [{"type": "object", "properties": {"a": {"not": {"type": "null"}}}}]}),
    P(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}),
    P(json={"type": "string", "format": "color"}),
    P(json={"type": "string", "pattern": "^a+$", "maxLength": 3}),
    P(json={"type": "number", "multipleOf": 0.5}),
    P(json={"type": "number", "multipleOf": 2}),
    P(json={"type": "object", "properties": {"a": {}}, "patternProperties": {"^b": {}}}),
    P(json={"$ref": "https://example.com/schema.json"}),
    P(grammar='start: "a" B\nB: /[0-9]+/'),  # Lark
    P(regex="[[:alpha:]]+"),
])
def test_auto_serves_with_llguidance_what_xgrammar_does_not_enforce(params):
    assert backend_for(params, AUTO) == "guidance"
    assert backend_for(params, StructuredOutputsConfig(backend="xgrammar")) == "xgrammar"


def test_a_named_backend_serves_every_request():
    for name, served_by in (("guidance", "guidance"), ("llguidance", "guidance"),
                            ("xgrammar", "xgrammar")):
        config = StructuredOutputsConfig(backend=name)
        assert backend_for(P(json=PERSON), config) == served_by
        assert backend_for(P(json={"type": "array", "uniqueItems": True}), config) == served_by


@pytest.fixture(scope="module")
def backends(tiny_tokenizer):
    return (GuidanceBackend(tiny_tokenizer, VOCAB, AUTO),
            XgrammarBackend(tiny_tokenizer, VOCAB, AUTO))


def _accepts(backend, params: StructuredOutputsParams, text: str, tokenizer) -> bool:
    matcher = backend.matcher(backend.compile(params))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(2)  # eos


def test_auto_falls_back_to_llguidance_where_xgrammar_cannot_compile(tiny_tokenizer):
    """A regex xgrammar cannot read (a case-insensitive flag) goes to xgrammar by auto's
    rule; its compile fails, and llguidance (which the API side checked it with) serves it."""
    manager = StructuredOutputManager(AUTO, lambda: tiny_tokenizer, VOCAB)
    params = P(regex="(?i)ab")
    assert backend_for(params, AUTO) == "xgrammar"
    request = Request("r", [5, 6], SamplingParams(structured_outputs=params), frozenset({2, 0}))
    manager.add_request(request)
    manager.wait_for_compiles(10)
    so = request.structured_output_request
    assert so.is_ready, so.error
    [(served_by, _)] = manager._cache.values()
    assert served_by.name == "guidance"
    assert [so.accept_token(t) for t in tiny_tokenizer.encode("aB", add_special_tokens=False)][-1]
    manager.shutdown()


# ----------------------------------------------------------------- what xgrammar ignores

def _xgrammar_accepts(info: xgr.TokenizerInfo, schema, text: str) -> bool:
    """xgrammar's own reading of ``schema`` (not loom's) accepts ``text`` whole."""
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=False))
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


IGNORED = {  # keyword -> (a schema using it, an instance that breaks it)
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "1"),
    "then": ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "1"),
    "else": ({"if": {"type": "integer"}, "else": {"type": "integer"}}, '"x"'),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, "[1,1]"),
    "contains": ({"type": "array", "contains": {"const": 3}}, "[1]"),
    "minContains": ({"type": "array", "contains": {"const": 3}, "minContains": 2}, "[1,1]"),
    "maxContains": ({"type": "array", "contains": {"const": 3}, "maxContains": 1}, "[3,3]"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
                         '{"a":1}'),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, '{"a":1}'),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {}},
                               "unevaluatedProperties": False}, '{"a":1,"b":2}'),
}


def test_the_keywords_routed_away_from_xgrammar_are_those_it_ignores(tiny_tokenizer):
    """Each keyword in XGRAMMAR_IGNORED_KEYWORDS: xgrammar takes an instance breaking it;
    the neighbours it is trusted with, it enforces. (An xgrammar that starts enforcing
    one fails this test: then it may leave the list.)"""
    info = tokenizer_info(tiny_tokenizer.hf, VOCAB, [2])
    assert set(IGNORED) == XGRAMMAR_IGNORED_KEYWORDS
    for keyword, (schema, breaking) in IGNORED.items():
        assert _xgrammar_accepts(info, schema, breaking), keyword
    for schema, breaking in (({"type": "integer", "multipleOf": 5}, "7"),
                             ({"type": "array", "minItems": 2}, "[1]"),
                             ({"type": "object", "maxProperties": 1}, '{"a":1,"b":2}'),
                             ({"type": "string", "format": "email"}, '"x"'),
                             ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, '"x"')):
        assert not _xgrammar_accepts(info, schema, breaking), schema


def test_length_bounded_strings_hold_json_s_characters(backends, tiny_tokenizer):
    """xgrammar's own grammar for a string with maxLength lets a control character in raw
    (not JSON) and refuses escapes; loom's holds JSON's characters, as llguidance does."""
    info = tokenizer_info(tiny_tokenizer.hf, VOCAB, [2])
    schema = {"type": "string", "maxLength": 3}
    assert _xgrammar_accepts(info, schema, '"a\x01"')
    assert not _xgrammar_accepts(info, schema, '"a\\n"')
    for backend in backends:
        accepts = lambda text: _accepts(backend, P(json=schema), text, tiny_tokenizer)  # noqa: E731
        assert not accepts('"a\x01"') and accepts('"a\\n"') and accepts('"\\"bc"')
        assert not accepts('"abcd"'), backend.name


# ----------------------------------------------------------------- same masks

def _allowed(matcher) -> set[int]:
    bitmask = np.full((1, (VOCAB + 31) // 32), -1, dtype="<i4")
    matcher.fill_bitmask(bitmask, 0)
    return set(np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")))


@pytest.mark.parametrize("params, text", [
    (P(choice=["yes", "no", "no way"]), "no way"),
    (P(regex="[a-z]{2,6}-[0-9]{1,3}"), "ab-12"),
    (P(grammar='root ::= "(" expr ")"\nexpr ::= [1-9] (("+" | "*") [1-9]){0,4}'), "(1+2*3)"),
    (P(json=PERSON, disable_any_whitespace=True), '{"n":12,"s":"a\\nb","e":"cd","l":[true]}'),
    (P(json=PERSON), '{ "n": 12, "s":"ab" ,"e":"cd",\n  "l":[ ]}'),
])
def test_both_backends_allow_the_same_tokens_at_every_step(backends, tiny_tokenizer, params,
                                                           text):
    """Along ``text``, token by token, both backends' masks are equal and both end the
    request after its last token. In JSON strings xgrammar also allows a raw DEL and the
    escape \\/ (both JSON); nothing else differs."""
    guidance, xgrammar = (backend.matcher(backend.compile(params)) for backend in backends)
    json_extras = {tiny_tokenizer.hf.convert_tokens_to_ids("ġ"),  # DEL, byte-level
                   tiny_tokenizer.encode("/", add_special_tokens=False)[0]}
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    for step, token_id in enumerate(ids):
        differ = _allowed(guidance) ^ _allowed(xgrammar)
        assert differ <= (json_extras if params.kind == "json" else set()), (step, differ)
        assert token_id in _allowed(xgrammar)
        assert guidance.accept_token(token_id) and xgrammar.accept_token(token_id)
        last = step == len(ids) - 1
        assert guidance.is_terminated() == xgrammar.is_terminated() == (
            last and params.kind != "regex"), step  # the regex may go on to 3 digits
    assert _allowed(guidance) == _allowed(xgrammar)


@pytest.mark.parametrize("backend_index", [0, 1])
def test_whitespace_options_mean_the_same(backends, tiny_tokenizer, backend_index):
    backend = backends[backend_index]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def accepts(text, **options):
        return _accepts(backend, P(json=schema, **options), text, tiny_tokenizer)

    assert accepts('{"a":1}', disable_any_whitespace=True)
    assert not accepts('{"a": 1}', disable_any_whitespace=True)
    assert accepts('{ "a" :\n\t1 }')
    assert accepts("{" + " " * 20 + '"a":1}') and not accepts("{" + " " * 21 + '"a":1}')



@pytest.mark.parametrize("backend_index", [0, 1])
def test_special_tokens_are_never_text_in_a_json_string(backends, tiny_tokenizer, backend_index):
    """Inside a JSON string any text goes, but not a special token ("<|im_start|>"), which
    xgrammar's own reading of a byte-level vocabulary would take for its text."""
    backend = backends[backend_index]
    matcher = backend.matcher(backend.compile(P(json={"type": "string"})))
    assert matcher.accept_token(tiny_tokenizer.encode('"', add_special_tokens=False)[0])
    allowed = _allowed(matcher)
    assert tiny_tokenizer.encode("<", add_special_tokens=False)[0] in allowed
    assert not allowed & {0, 1, 2}  # <|endoftext|>, <|im_start|>, <|im_end|>
