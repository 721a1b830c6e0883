"""llguidance's tokenizer for any Hugging Face tokenizer.

llguidance reads a fast tokenizer's JSON itself (``llguidance.hf.from_tokenizer``), which
needs a decoder it knows (byte-level BPE, or SentencePiece's byte fallback spelled as a
``Sequence``). Some conversions of ERNIE-, Llama- and Gemma-style tokenizers ship
SentencePiece's ``Metaspace`` decoder instead, which it refuses ("can't determine decoder
type"). For those, ``ll_tokenizer`` builds the token table itself, from the tokenizer's
own decoding of each id: the bytes a token adds when it follows another token (so that a
``▁`` that decodes to a space keeps it, as it does mid-text), a byte-fallback token
``<0xNN>`` as its one byte where the decoder turns it into that byte, a special token as
its text (and marked special, so that no grammar matches it as text).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import llguidance

logger = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def ll_tokenizer(hf: Any, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``hf`` (a ``PreTrainedTokenizerFast``) over ``n_vocab``
    ids (the model's, which may pad past the tokenizer's)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos_token_ids or None)
    except ValueError as error:  # a decoder llguidance does not read
        logger.info("structured outputs: llguidance cannot read this tokenizer (%s); its "
                    "token table is built from the tokenizer's own decoding", error)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenTable(hf, n_vocab,
                                                                          eos_token_ids)))


class TokenTable:
    """The bytes of every token id as the tokenizer decodes it, and its encoder: what
    llguidance's ``TokenizerWrapper`` reads (``tokens``, ``eos_token_id``,
    ``bos_token_id``, ``special_token_ids``, and a call that encodes text)."""

    def __init__(self, hf: Any, n_vocab: int, eos_token_ids: list[int]) -> None:
        self._encoder = _encoder_without_prepended_space(hf)
        self.eos_token_id = (eos_token_ids or [hf.eos_token_id])[0]
        self.bos_token_id = hf.bos_token_id
        special = special_token_ids(hf)
        self.special_token_ids = sorted(i for i in special if i < n_vocab)
        self.tokens = token_bytes(hf, n_vocab, special)

    def __call__(self, text: str) -> list[int]:
        """``text``'s ids as a piece of a longer text: without the space a SentencePiece
        tokenizer puts in front of a whole text (llguidance tokenizes grammar literals
        and continuations with this)."""
        return self._encoder.encode(text, add_special_tokens=False).ids


def special_token_ids(hf: Any) -> set[int]:
    """The tokenizer's special tokens (its named ones and added tokens marked special):
    never text to a grammar."""
    return set(hf.all_special_ids) | {
        token_id for token_id, added in hf.added_tokens_decoder.items() if added.special}


def _encoder_without_prepended_space(hf: Any) -> Any:
    """``hf``'s Rust tokenizer, less what prepends "▁" to a whole text: a Metaspace
    pre-tokenizer's ``prepend_scheme`` (set to never) and a ``Prepend`` normalizer (the
    older Llama tokenizer.json spelling), wherever they sit in a ``Sequence``."""
    from tokenizers import Tokenizer

    spec = json.loads(hf.backend_tokenizer.to_str())

    def edit(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("type") == "Metaspace":
                node = {**node, "prepend_scheme": "never", "add_prefix_space": False}
            parts = [edit(part) for part in node.get("normalizers", node.get("pretokenizers",
                                                                             []))
                     if not (isinstance(part, dict) and part.get("type") == "Prepend")]
            for key in ("normalizers", "pretokenizers"):
                if key in node:
                    node = {**node, key: parts}
            if node.get("type") == "Prepend":
                return None
        return node

    spec["normalizer"] = edit(spec.get("normalizer"))
    spec["pre_tokenizer"] = edit(spec.get("pre_tokenizer"))
    encoder = Tokenizer.from_str(json.dumps(spec))
    encoder.no_padding()
    encoder.no_truncation()
    return encoder


def token_bytes(hf: Any, n_vocab: int, special: set[int]) -> list[bytes]:
    """Each id's bytes: what it adds to the decoding of a text it follows.

        anchor "a", id "▁hello": decode([a, ▁hello]) = "a hello" -> " hello"
        id "<0x0A>": b"\\n" where the decoder has byte fallback (a partial UTF-8 byte
        alone decodes to U+FFFD)
    """
    size = len(hf)
    anchor = _anchor(hf, special)
    pieces = hf.convert_ids_to_tokens(list(range(size)))
    prefix = hf.decode([anchor], clean_up_tokenization_spaces=False)
    texts = hf.batch_decode([[anchor, i] for i in range(size)],
                            clean_up_tokenization_spaces=False)
    table: list[bytes] = []
    for token_id, (piece, text) in enumerate(zip(pieces, texts)):
        byte = _BYTE_TOKEN.fullmatch(piece or "")
        if byte is not None and not text.endswith(piece):  # the decoder's byte fallback
            table.append(bytes([int(byte.group(1), 16)]))
        elif token_id in special:
            table.append((piece or "").encode())
        elif text.startswith(prefix):
            table.append(text[len(prefix):].encode())
        else:  # the pair does not decode as the anchor then the token: the piece itself
            table.append((piece or "").replace("▁", " ").encode())
    return table + [b""] * (n_vocab - size)  # the model's padding ids: no text


def _anchor(hf: Any, special: set[int]) -> int:
    """An ordinary token whose decoding stays put whatever follows it: a letter's."""
    for text in ("a", "x", "0"):
        ids = [i for i in hf.encode(text, add_special_tokens=False) if i not in special]
        if len(ids) == 1:
            return ids[0]
    return next(i for i in range(len(hf)) if i not in special)
