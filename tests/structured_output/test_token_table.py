"""Grammars on every tokenizer: a SentencePiece-style tokenizer with the Metaspace decoder,
which llguidance cannot read itself (and xgrammar would read raw), gets its token table
from its own decoding, for both backends."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from tokenizer_fixtures import make_tiny_metaspace_tokenizer
from transformers import AutoTokenizer

from loom.structured_output.token_table import TokenTable, ll_tokenizer

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_metaspace_tokenizer(
        str(tmp_path_factory.mktemp("metaspace"))))


def test_llguidance_cannot_read_the_metaspace_decoder_itself(metaspace):
    with pytest.raises(ValueError, match="can't determine decoder type"):
        llguidance.hf.from_tokenizer(metaspace, n_vocab=len(metaspace))


def test_each_token_is_what_it_adds_to_a_text(metaspace):
    n_vocab = len(metaspace) + 7  # a model that pads its vocabulary past the tokenizer's
    table = TokenTable(metaspace, n_vocab, [metaspace.eos_token_id])
    assert len(table.tokens) == n_vocab and table.tokens[len(metaspace):] == [b""] * 7
    by_piece = dict(zip(metaspace.convert_ids_to_tokens(list(range(len(metaspace)))),
                        table.tokens))
    assert by_piece["▁hello"] == b" hello" and by_piece["ll"] == b"ll"
    assert by_piece["▁"] == b" " and by_piece['":'] == b'":'
    assert by_piece["</s>"] == b"</s>"
    assert set(table.special_token_ids) == {0, 1, 2} and table.eos_token_id == 2
    # the pieces of any text, their bytes joined, give the text as the tokenizer decodes
    # it after a first token (whose own leading space the decoder strips)
    for text in ['x {"age": 12}', "hello world, the name is A-7!", "a  b"]:
        ids = metaspace.encode(text, add_special_tokens=False)
        first = metaspace.decode(ids[:1])
        assert b"".join(table.tokens[i] for i in ids[1:]).decode() == \
            metaspace.decode(ids)[len(first):]


def test_a_json_schema_constrains_this_tokenizer(metaspace):
    tokenizer = ll_tokenizer(metaspace, len(metaspace), [metaspace.eos_token_id])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.tokenize_str('{"age":42}')  # as a piece of text: no space put first
    assert metaspace.convert_ids_to_tokens(ids)[0] == "{"
    for token in ids:
        assert matcher.consume_token(token), (token, matcher.get_error())
    assert matcher.is_accepting()


def test_xgrammar_reads_this_tokenizer_as_loom_s_table(metaspace):
    """xgrammar would read the Metaspace vocabulary raw ("▁hello" as those bytes); its
    TokenizerInfo is loom's table instead, special tokens without bytes."""
    from loom.structured_output.xgrammar_backend import tokenizer_info

    n_vocab = len(metaspace) + 7
    info = tokenizer_info(metaspace, n_vocab, [metaspace.eos_token_id])
    table = TokenTable(metaspace, n_vocab, [metaspace.eos_token_id])
    special = set(table.special_token_ids)
    assert info.decoded_vocab == [b"" if i in special else token
                                  for i, token in enumerate(table.tokens)]
    assert info.stop_token_ids == [metaspace.eos_token_id]


def test_a_json_schema_constrains_this_tokenizer_with_xgrammar(metaspace):
    from types import SimpleNamespace

    from loom.config import StructuredOutputsConfig
    from loom.sampling_params import StructuredOutputsParams
    from loom.structured_output.xgrammar_backend import XgrammarBackend

    tokenizer = SimpleNamespace(hf=metaspace, eos_token_ids={metaspace.eos_token_id})
    backend = XgrammarBackend(tokenizer, len(metaspace), StructuredOutputsConfig())
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True)))
    ids = ll_tokenizer(metaspace, len(metaspace), [2]).tokenize_str('{"age":42}')
    for token in ids:
        assert matcher.accept_token(token), token
    assert matcher.is_terminated()
