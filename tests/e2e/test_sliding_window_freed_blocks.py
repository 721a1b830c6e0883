"""Blocks every sliding-window layer has left behind are freed while a request runs,
and no kernel reads them again: the test fills each freed block with NaN (any read
of it would turn the logits to NaN) and still gets transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import SLIDING_WINDOW, make_tiny_checkpoint
from test_llm_correctness import hf_greedy
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def mistral_case(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint("mistral_sliding", tmp_path_factory.mktemp("mistral"))
    make_tiny_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 288) for _ in range(n)] for n in (5, 13, 40, 100, 150)]
    with torch.no_grad():
        expected = [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    return path, prompts, expected


def _poison_freed_blocks(llm: LLM) -> list[int]:
    """From now on every block the KV manager frees early is filled with NaN in the
    worker's cache, in every layer, K and V. Returns the list the freed ids go to."""
    manager = llm.engine.engine_core.scheduler.kv_cache
    storage = llm.engine.engine_core.executor.worker.model_runner.kv_cache_storage
    free_early, poisoned = manager._free_blocks_outside_window, []

    def free_and_poison(request_id, blocks, num_computed):
        held = [block for block in blocks if block is not None]
        free_early(request_id, blocks, num_computed)
        freed = [block.block_id for block in held if block.ref_cnt == 0]
        storage[:, :, :, freed] = float("nan")  # (L, 2, Hkv, blocks, block_size, D)
        poisoned.extend(freed)

    manager._free_blocks_outside_window = free_and_poison
    return poisoned


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_freed_blocks_are_never_read(mistral_case, attention_backend):
    """Prompts of 5..150 tokens (window 12), chunked by a 32-token budget, 16 greedy
    tokens each, in one batch: freed blocks hold NaN and the tokens are transformers'."""
    path, prompts, expected = mistral_case
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              max_num_batched_tokens=32, enable_prefix_caching=False,
              attention_backend=attention_backend)
    assert llm.engine.engine_core.executor.kv_cache_window == SLIDING_WINDOW
    poisoned = _poison_freed_blocks(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, want in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == want, f"{len(prompt)}-token prompt"
    # the longest request alone left (150 + 16 - 12) // 4 = 38 blocks behind its window
    assert len(poisoned) >= 38
    assert llm.engine.engine_core.scheduler.kv_cache.num_blocks_freed_early == len(poisoned)
    llm.shutdown()


def test_worker_processes_report_the_window(mistral_case):
    """The window travels from a worker process through its signals: the engine frees
    early there too, and the tokens are transformers'."""
    path, prompts, expected = mistral_case
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              distributed_executor_backend="mp")
    assert llm.engine.engine_core.executor.kv_cache_window == SLIDING_WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.engine_core.scheduler.kv_cache.num_blocks_freed_early > 0
    llm.shutdown()


def test_a_model_with_full_attention_layers_frees_nothing_early(tmp_path):
    """Gemma 3 interleaves global layers, which read every position: no window."""
    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    make_tiny_tokenizer(path)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              enable_warm_up=False)
    assert llm.engine.engine_core.executor.kv_cache_window == 0
    assert llm.engine.engine_core.scheduler.kv_cache.sliding_window is None
    llm.generate([{"prompt_token_ids": list(range(3, 60))}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.engine_core.scheduler.kv_cache.num_blocks_freed_early == 0
    llm.shutdown()
