"""Incremental detokenization on tokenizers' DecodeStream (FastIncrementalDetokenizer) and on
the Python path (IncrementalDetokenizer): streamed text equals the full decode, on the tiny
byte-level tokenizer and the default model's (SmolLM2 GGUF). No network."""

from __future__ import annotations

import random

import pytest

from loom.core.wire import EngineCoreOutput
from loom.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer, make_detokenizer
from loom.output_processor import OutputProcessor
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer, load_tokenizer
from test_tokenizer import MIXED_TEXT
from tokenizer_fixtures import make_tiny_tokenizer

DETOKENIZERS = [FastIncrementalDetokenizer, IncrementalDetokenizer]
TOKENIZERS = ["tiny", "smollm2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny_tokenizer"))))


# smollm2: a session fixture in tests/conftest.py, converted once from the GGUF file.


def stream(detokenizer, token_ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Deltas of token_ids fed one at a time, or in random chunks, then flush()."""
    deltas, position = [], 0
    while position < len(token_ids):
        size = rng.choice([1, 1, 1, 2, 3, 7]) if rng else 1
        deltas.append(detokenizer.update(token_ids[position:position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


def random_ids(tokenizer: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids with many byte tokens (partial UTF-8 characters) and special tokens among them."""
    specials = tokenizer.hf.all_special_ids
    byte_range = min(tokenizer.vocab_size, 300)  # byte tokens and early merges
    return [rng.choice(specials) if rng.random() < 0.05
            else rng.randrange(byte_range) if rng.random() < 0.6
            else rng.randrange(tokenizer.vocab_size) for _ in range(length)]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_default_and_tiny_tokenizers_take_the_fast_path(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer = request.getfixturevalue(name)
    assert isinstance(make_detokenizer(tokenizer, [1, 2, 3]), FastIncrementalDetokenizer)


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_to_the_full_decode(request: pytest.FixtureRequest, cls, name: str,
                                              skip_special_tokens: bool) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(f"{name}-{skip_special_tokens}")
    num_split_characters = 0
    for _ in range(60):
        # A prompt that ends on a character boundary, or none.
        prompt_ids = tokenizer.encode(rng.choice(["", "Q: 你好 😀 ", "Say something: "]))
        output_ids = random_ids(tokenizer, rng, rng.randrange(1, 120))
        detokenizer = cls(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        deltas = stream(detokenizer, output_ids, rng)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        num_split_characters += sum(tokenizer.decode(output_ids[:n]).endswith("\ufffd")
                                    for n in range(1, len(output_ids)))
    assert num_split_characters > 100  # the ids did split characters between tokens


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_streams_whole_characters_only(request: pytest.FixtureRequest, cls, name: str,
                                            skip_special_tokens: bool) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    output_ids = (tokenizer.encode(MIXED_TEXT, add_special_tokens=False) + [im_end]
                  + tokenizer.encode(" after 😀", add_special_tokens=False))
    full_text = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in full_text) != skip_special_tokens
    assert any(tokenizer.decode(output_ids[:n]).endswith("\ufffd") for n in range(len(output_ids)))
    detokenizer = cls(tokenizer, tokenizer.encode("Question: 你好?"), skip_special_tokens)
    deltas = stream(detokenizer, output_ids)
    assert "".join(deltas) == full_text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing held back at the end


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_flush_releases_an_unfinished_character(tiny: Tokenizer, cls) -> None:
    emoji_ids = tiny.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    detokenizer = cls(tiny, tiny.encode("x"))
    assert detokenizer.update(tiny.encode("ok ", add_special_tokens=False)) == "ok "
    assert detokenizer.update(emoji_ids[:-1]) == ""
    assert detokenizer.flush() == tiny.decode(emoji_ids[:-1]) == "\ufffd"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_fast_path_streams_the_full_decode_after_any_prompt(request: pytest.FixtureRequest,
                                                            name: str) -> None:
    """Prompts of random ids, often ending inside a character that the output completes:
    no prompt text leaks into the output, which reads as a full decode of it."""
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(name)
    for _ in range(100):
        prompt_ids = random_ids(tokenizer, rng, rng.randrange(0, 40))
        output_ids = random_ids(tokenizer, rng, rng.randrange(1, 30))
        detokenizer = FastIncrementalDetokenizer(tokenizer, prompt_ids)
        assert "".join(stream(detokenizer, output_ids, rng)) == tokenizer.decode(output_ids)
    emoji_ids = tokenizer.encode("a 😀", add_special_tokens=False)
    dog_ids = tokenizer.encode(" dog", add_special_tokens=False)
    detokenizer = FastIncrementalDetokenizer(tokenizer, emoji_ids[:-1])
    assert "".join(stream(detokenizer, emoji_ids[-1:] + dog_ids)) == "\ufffd dog"


def test_decode_stream_error_hands_over_to_the_python_path(tiny: Tokenizer, caplog) -> None:
    class FailingStream:
        """DecodeStream's "Invalid prefix" failure, after two good tokens."""

        def __init__(self, real) -> None:
            self.real, self.calls = real, 0

        def step(self, backend, token_id):
            self.calls += 1
            if self.calls == 3:
                raise Exception("Invalid prefix encountered while decoding stream")
            return self.real.step(backend, token_id)

    output_ids = tiny.encode("ab 😀 你好 the end", add_special_tokens=False)
    detokenizer = FastIncrementalDetokenizer(tiny, tiny.encode("x"))
    detokenizer._stream = FailingStream(detokenizer._stream)
    assert "".join(stream(detokenizer, output_ids)) == "ab 😀 你好 the end"
    assert "continues on the Python detokenizer" in caplog.text


def test_output_processor_streams_through_the_fast_path(smollm2: Tokenizer) -> None:
    processor = OutputProcessor(smollm2)
    prompt_ids = smollm2.encode("Hi")
    params = SamplingParams(max_tokens=100, n=2, skip_special_tokens=True)
    request_ids = processor.add_request("r", "Hi", prompt_ids, params, stream=True)
    assert all(isinstance(seq.detokenizer, FastIncrementalDetokenizer)
               for seq in processor.requests["r"].sequences)
    output_ids = smollm2.encode("Bonjour 😀 ça va? 你好", add_special_tokens=False)
    texts = {request_id: "" for request_id in request_ids}
    for position, token_id in enumerate(output_ids):
        last = position == len(output_ids) - 1
        outputs = processor.process_outputs([
            EngineCoreOutput(req_id=request_id, new_token_ids=[token_id],
                             finish_reason="length" if last else None)
            for request_id in request_ids]).request_outputs
        for completion in outputs[0].outputs:
            texts[request_ids[completion.index]] += completion.text
    assert list(texts.values()) == ["Bonjour 😀 ça va? 你好"] * 2
