"""Benchmark datasets: lengths, seeding, shared prefixes, the ShareGPT-shaped distribution,
copy-the-code prompts."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from loom.bench.datasets import (REPEAT_INSTRUCTION, random_requests, repeat_requests,
                                 sharegpt_lengths, sharegpt_synthetic_requests,
                                 shared_prefix_requests)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_random_with_tokenizer_has_exact_lengths(tokenizer):
    requests = random_requests(20, input_len=32, output_len=16, tokenizer=tokenizer, seed=0)
    for r in requests:
        assert r.prompt_len == 32 == len(r.prompt_token_ids)
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids
        assert r.output_len == 16


def test_random_range_ratio_spreads_lengths():
    requests = random_requests(200, input_len=100, output_len=50, range_ratio=0.5, seed=0)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert 50 <= min(inputs) and max(inputs) <= 150 and len(set(inputs)) > 20
    assert 25 <= min(outputs) and max(outputs) <= 75
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_random_words_without_tokenizer_are_seeded():
    a = random_requests(3, 8, 4, seed=5)
    b = random_requests(3, 8, 4, seed=5)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(len(r.prompt.split()) == 8 and r.prompt_token_ids is None for r in a)


def test_shared_prefix_requests_share_their_prefix_ids(tokenizer):
    requests = shared_prefix_requests(8, prefix_len=24, suffix_len=8, output_len=4,
                                      num_prefixes=2, tokenizer=tokenizer, seed=0)
    prefixes = {tuple(r.prompt_token_ids[:24]) for r in requests}
    assert len(prefixes) == 2
    assert all(len(r.prompt_token_ids) == 32 for r in requests)


def test_sharegpt_synthetic_shape():
    inputs, outputs = sharegpt_lengths(5000, seed=0)
    assert inputs.min() >= 4 and inputs.max() <= 1024 and outputs.max() <= 1024
    assert np.all(inputs + outputs <= 2048)
    # Long right tail: mean well above median, as in ShareGPT.
    assert 85 <= np.median(inputs) <= 115 and inputs.mean() > 1.5 * np.median(inputs)
    assert 130 <= np.median(outputs) <= 170 and outputs.mean() > 1.3 * np.median(outputs)
    requests = sharegpt_synthetic_requests(10, seed=0)
    assert [r.output_len for r in requests] == sharegpt_lengths(10, seed=0)[1].tolist()


def test_repeat_requests_ask_to_copy_code_under_the_chat_template(tokenizer):
    requests = repeat_requests(6, input_len=200, output_len=32, tokenizer=tokenizer, seed=3)
    assert [r.prompt for r in requests] == \
        [r.prompt for r in repeat_requests(6, 200, 32, tokenizer=tokenizer, seed=3)]
    assert len({r.chat_message for r in requests}) == 6
    for r in requests:
        assert r.chat_message.startswith(REPEAT_INSTRUCTION) and "def " in r.chat_message
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": r.chat_message}],
                                                 tokenize=False, add_generation_prompt=True)
        assert r.prompt == rendered
        assert r.prompt_token_ids == tokenizer.encode(r.prompt, add_special_tokens=False)
        assert r.prompt_len == len(r.prompt_token_ids)
        assert 150 <= r.prompt_len <= 200 and r.output_len == 32


def test_repeat_requests_without_tokenizer_are_plain_messages():
    requests = repeat_requests(2, input_len=100, output_len=8, seed=0)
    assert all(r.prompt == r.chat_message and r.prompt_token_ids is None for r in requests)
    assert all(r.prompt_len == -(-len(r.prompt) // 4) <= 100 for r in requests)
