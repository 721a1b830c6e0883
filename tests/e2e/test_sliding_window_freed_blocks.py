"""Blocks every sliding-window layer has left behind are freed while a request runs,
and no kernel reads them again: the test fills each freed block with NaN (any read
of it would turn the logits to NaN) and still gets transformers' greedy tokens.
Mistral (every layer windowed: one block table) and Gemma 3 (local and global layers:
a hybrid KV cache, whose sliding groups free blocks while the full group keeps all)."""

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


@pytest.fixture(scope="module", params=["mistral_sliding", "gemma3"])
def sliding_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
    make_tiny_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 288) for _ in range(n)] for n in (5, 13, 40, 100, 150)]
    with torch.no_grad():
        expected = [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    return family, path, prompts, expected


def _poison_freed_blocks(llm: LLM) -> list[tuple[int, int]]:
    """From now on every block the KV manager frees early is filled with NaN in the
    worker's cache, in every layer slot, K and V. Returns the list the freed
    (group, block id) pairs go to."""
    manager = llm.engine.engine_core.scheduler.kv_cache
    storage = llm.engine.engine_core.executor.worker.model_runner.kv_cache_storage
    free_early, poisoned = manager._free_blocks_outside_window, []

    def free_and_poison(request_id, group, blocks, num_computed, window):
        held = [block for block in blocks if block is not None]
        free_early(request_id, group, blocks, num_computed, window)
        freed = [block.block_id for block in held if block.ref_cnt == 0]
        storage[:, :, :, freed] = float("nan")  # (slots, 2, Hkv, blocks, block_size, D)
        poisoned.extend((group, block_id) for block_id in freed)

    manager._free_blocks_outside_window = free_and_poison
    return poisoned


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_freed_blocks_are_never_read(sliding_case, attention_backend):
    """Prompts of 5..150 tokens (window 12), chunked by a 32-token budget, 16 greedy
    tokens each, in one batch: freed blocks hold NaN and the tokens are transformers'."""
    family, path, prompts, expected = sliding_case
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              max_num_batched_tokens=32, enable_prefix_caching=False,
              attention_backend=attention_backend, enable_warm_up=False)
    executor = llm.engine.engine_core.executor
    manager = llm.engine.engine_core.scheduler.kv_cache
    assert executor.kv_cache_window == SLIDING_WINDOW
    # Gemma 3's layers: local, global, local -> groups [global], [local], [local]
    want_groups = [12] if family == "mistral_sliding" else [None, 12, 12]
    assert manager.group_windows == tuple(want_groups) == tuple(executor.kv_cache_groups)
    poisoned = _poison_freed_blocks(llm)
    full_group_lengths = {}
    allocate = manager.allocate_slots

    def allocate_and_check(request, *args, **kwargs):
        new_blocks = allocate(request, *args, **kwargs)
        groups = manager.req_to_blocks.get(request.request_id, [])
        for group, window in enumerate(manager.group_windows):
            if window is None:  # a full group keeps every block
                assert None not in groups[group]
                full_group_lengths[request.request_id] = len(groups[group])
        return new_blocks

    manager.allocate_slots = allocate_and_check
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, want in zip(prompts, outputs, expected):
        assert output.outputs[0].token_ids == want, f"{len(prompt)}-token prompt"
    # the longest request alone left (150 + 16 - 12) // 4 = 38 blocks behind its window,
    # in each sliding group
    num_sliding = sum(window is not None for window in want_groups)
    assert len(poisoned) >= 38 * num_sliding
    assert {group for group, _ in poisoned} == {
        group for group, window in enumerate(want_groups) if window is not None}
    assert manager.num_blocks_freed_early == len(poisoned)
    if family == "gemma3":  # the global layers' group held every position to the end
        assert max(full_group_lengths.values()) == -(-(150 + 15) // BLOCK_SIZE)
    llm.shutdown()


def test_worker_processes_report_the_window(sliding_case):
    """The window and the groups travel from a worker process through its signals: the
    engine frees early there too, and the tokens are transformers'."""
    family, path, prompts, expected = sliding_case
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              distributed_executor_backend="mp", enable_warm_up=False)
    assert llm.engine.engine_core.executor.kv_cache_window == SLIDING_WINDOW
    assert len(llm.engine.engine_core.scheduler.kv_cache.group_windows) == (
        1 if family == "mistral_sliding" else 3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.engine_core.scheduler.kv_cache.num_blocks_freed_early > 0
    llm.shutdown()
