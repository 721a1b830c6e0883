"""Speculative decoding, early stop and prompt logprobs through the offline API, on the
tiny Llama (float32).

Greedy output with n-gram and with draft-model speculation equals output without, token
for token, for a batch of mixed lengths, with chunked prefill and with preemption, and
with a draft model beside a target sharded over two ranks; drafts are accepted. Seeded
sampled output is reproducible with speculation. Early stop ends a near-certain request
after its window. Prompt logprobs equal transformers' log_softmax at every prompt
position, with prefills chunked.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 16


def one_layer_copy(path: str, dest: str) -> str:
    """The tiny Llama cut to its first layer: a cheaper, less accurate draft model
    with the same vocabulary and tokenizer."""
    shutil.copytree(path, dest, dirs_exist_ok=True)
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 1
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    weights = load_file(os.path.join(dest, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".layers.1." not in k},
              os.path.join(dest, "model.safetensors"))
    return dest


def make_prompts() -> list[list[int]]:
    """Mixed lengths; most repeat a short pattern, so prompt lookup finds drafts."""
    rng = random.Random(3)
    prompts = []
    for length in (1, 4, 9, 17, 40, 70, 130):
        pattern = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 7))]
        prompts.append((pattern * 200)[:length])
    prompts.append([rng.randrange(3, 256) for _ in range(50)])  # no repetition
    return prompts


CONFIGS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "preemption": dict(num_gpu_blocks_override=40, block_size=4, max_model_len=160),
}


@pytest.fixture(scope="module")
def draft_1layer(tiny_llama, tmp_path_factory) -> str:
    return one_layer_copy(tiny_llama, str(tmp_path_factory.mktemp("draft-1layer")))


@pytest.fixture(scope="module")
def expected(tiny_llama) -> dict[str, list[list[int]]]:
    """Greedy tokens without speculation, per config."""
    result = {}
    for name, kwargs in CONFIGS.items():
        with LLM(tiny_llama, dtype="float32", **{"max_model_len": 256, **kwargs}) as llm:
            result[name] = generate_greedy(llm)
    assert result["default"] == result["chunked_prefill"] == result["preemption"]
    return result


def generate_greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params,
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_1layer"])
def test_greedy_output_equals_output_without_speculation(tiny_llama, draft_1layer, expected,
                                                         method, config_name):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4}
    if method != "ngram":
        spec = {"method": "draft_model", "num_speculative_tokens": 3,
                "model": tiny_llama if method == "draft_same" else draft_1layer}
    with LLM(tiny_llama, dtype="float32", speculative_config=spec,
             **{"max_model_len": 256, **CONFIGS[config_name]}) as llm:
        got = generate_greedy(llm)
        stats = llm.engine.engine_core.get_stats()
        assert not llm.engine.engine_core.has_unfinished_requests()
    for i, (g, e) in enumerate(zip(got, expected[config_name])):
        assert g == e, f"prompt {i}: with {method} {g} != without {e}"
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if method == "draft_same":  # the target drafting for itself: every draft is right
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if config_name == "preemption":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("config_name", ["default", "preemption"])
@pytest.mark.parametrize("method", ["draft_same", "draft_1layer"])
def test_draft_model_with_tensor_parallel_equals_output_without(tiny_llama, draft_1layer,
                                                                expected, method, config_name):
    """TP=2 in worker processes: the draft model runs unsharded on rank 0 only, beside
    rank 0's shard of the target; greedy tokens equal those of TP=1 without speculation."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3,
            "model": tiny_llama if method == "draft_same" else draft_1layer}
    with LLM(tiny_llama, dtype="float32", speculative_config=spec, tensor_parallel_size=2,
             **{"max_model_len": 256, **CONFIGS[config_name]}) as llm:
        assert type(llm.engine.engine_core.executor).__name__ == "MultiProcExecutor"
        got = generate_greedy(llm)
        stats = llm.engine.engine_core.get_stats()
    for i, (g, e) in enumerate(zip(got, expected[config_name])):
        assert g == e, f"prompt {i}: TP=2 with {method} {g} != without {e}"
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if method == "draft_same":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if config_name == "preemption":
        assert stats.num_preemptions > 0


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=MAX_NEW_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    with LLM(tiny_llama, dtype="float32", max_model_len=256, speculative_config=spec) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # alone, in reverse order: the batch does not change a seeded request's tokens
        alone = {i: llm.generate(prompts[i], params[i], use_tqdm=False)[0].outputs[0].token_ids
                 for i in (6, 3, 0)}
        assert llm.engine.engine_core.get_stats().spec_decode_num_accepted_tokens > 0
    assert {i: first[i] for i in alone} == alone


def test_early_stop_ends_a_near_certain_request(tiny_llama):
    config = {"enable_early_stop": True, "window_size": 6, "threshold": 0.99}
    prompt = {"prompt_token_ids": make_prompts()[-1]}
    certain = SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True,
                             logit_bias={77: 100.0})
    normal = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    with LLM(tiny_llama, dtype="float32", max_model_len=256, early_stop_config=config) as llm:
        stopped, unaffected = llm.generate([prompt, prompt], [certain, normal], use_tqdm=False)
    assert stopped.outputs[0].token_ids == [77] * 6
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == \
        ("stop", "early_stop")
    assert len(unaffected.outputs[0].token_ids) == 40
    assert unaffected.outputs[0].finish_reason == "length"
    with LLM(tiny_llama, dtype="float32", max_model_len=256) as llm:
        baseline = llm.generate(prompt, normal, use_tqdm=False)[0]
    assert baseline.outputs[0].token_ids == unaffected.outputs[0].token_ids


@pytest.mark.parametrize("speculative", [False, True])
def test_prompt_logprobs_match_transformers(tiny_llama, speculative):
    from transformers import AutoModelForCausalLM

    prompts = [p for p in make_prompts() if len(p) > 1]
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    kwargs = dict(max_num_batched_tokens=24)  # chunks every prompt longer than that
    if speculative:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    k = 3
    with LLM(tiny_llama, dtype="float32", max_model_len=256, **kwargs) as llm:
        # The same prompt twice: the second must not skip its prompt through the cache.
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[-1:]],
                               SamplingParams(max_tokens=3, prompt_logprobs=k, n=2, seed=0),
                               use_tqdm=False)
    for prompt, output in zip(prompts + prompts[-1:], outputs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for position, (token_id, entry) in enumerate(zip(prompt[1:], entries[1:])):
            row = expected[position]
            assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=1e-4)
            assert entry[token_id].rank == int((row > row[token_id]).sum()) + 1
            top = row.topk(k)
            for rank, (value, top_id) in enumerate(zip(top.values, top.indices), start=1):
                assert entry[int(top_id)].logprob == pytest.approx(float(value), abs=1e-4)
                if int(top_id) != token_id:
                    assert entry[int(top_id)].rank == rank
            assert len(entry) <= k + 1
