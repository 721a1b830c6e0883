"""Token-exact greedy equality with Hugging Face transformers, for every model family.

One ``LLM.generate`` call over prompts of mixed lengths (1 to 200 tokens, some sharing
long prefixes) must give, for each prompt, exactly the tokens transformers' greedy
``generate`` gives for that prompt alone (float32). Again with a token budget small
enough to chunk prefills, with few enough blocks to force preemption, and with
prefix caching off.

``LOOM_TEST_DEVICE=cuda`` runs the same matrix on a GPU, transformers there too
(``benchmarks/cuda_check.sh``); CI runs it on the CPU. ``LOOM_TEST_ATTENTION_BACKEND``
names the attention backend loom runs (default auto; ``triton`` on a GPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from checkpoints import FAMILIES, make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams

MAX_NEW_TOKENS = 8
DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")
ATTENTION_BACKEND = os.environ.get("LOOM_TEST_ATTENTION_BACKEND", "auto")

CONFIGS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "preemption": dict(num_gpu_blocks_override=24, block_size=16),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}
# A hybrid KV cache (Gemma 3: a full-attention group and two sliding ones) needs, per
# sequence of max_model_len, its 16 blocks in the full group and what a window and a
# step's tokens span in each sliding one: chunks of 32 keep that at 4.
FAMILY_CONFIGS = {"gemma3": {"preemption": dict(num_gpu_blocks_override=36, block_size=16,
                                                max_num_batched_tokens=32)}}


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab_size) for _ in range(150)]
    lengths = [1, 2, 5, 17, 33, 64, 100, 200]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
    # Long shared prefixes: hits in the prefix cache, within and across steps.
    prompts += [shared + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 7, 30)]
    prompts += [shared[:64], shared[:64] + [5]]
    return prompts


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Plain argmax over the full sequence each step: no logits processors, no cache."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    make_tiny_tokenizer(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    prompts = make_prompts(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = [hf_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    return path, prompts, expected, request.param


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers(family_case, config_name):
    path, prompts, expected, family = family_case
    config = FAMILY_CONFIGS.get(family, {}).get(config_name, CONFIGS[config_name])
    llm = LLM(path, device=DEVICE, dtype="float32", max_model_len=256, seed=0,
              attention_backend=ATTENTION_BACKEND, **config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): loom {g} != transformers {e}"
    stats = llm.engine.engine_core.get_stats()
    kv_cache = llm.engine.engine_core.scheduler.kv_cache
    if kv_cache.sliding_window is not None:
        # every layer windowed (Mistral): blocks behind the window went back to the pool,
        # which left the small pool room enough that nothing was preempted
        assert kv_cache.num_blocks_freed_early > 0
    elif config_name == "preemption":
        if kv_cache.num_groups > 1:  # hybrid: the sliding groups freed blocks meanwhile
            assert kv_cache.num_blocks_freed_early > 0
        assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    if config_name in ("default", "chunked_prefill"):
        assert stats.prefix_cache_hits > 0
    if config_name == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    assert not llm.engine.engine_core.has_unfinished_requests()
    if DEVICE == "cuda":  # decode steps ran as CUDA graphs where they apply
        graphs = llm.collective_rpc("cuda_graph_stats")[0]
        print(f"{family} {config_name}: CUDA graphs {graphs}")
        assert graphs["disabled"] is None, graphs
        assert graphs["replays"] > 0, graphs  # Gemma 3's hybrid KV cache included
    llm.shutdown()


def test_decode_after_weight_updates_and_sleep_gives_the_same_tokens(tmp_path):
    """The same weights loaded again (``update_weights``), then the KV cache and the
    weights freed and brought back (``sleep(2)``, ``wake_up``): the same greedy tokens
    each time. On CUDA, decode steps are replayed from CUDA graphs again after each
    (the graphs were dropped with what they read, and captured anew)."""
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    make_tiny_tokenizer(path)
    prompts = make_prompts(256)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    with LLM(path, device=DEVICE, dtype="float32", max_model_len=256, seed=0) as llm:
        def run() -> list[list[int]]:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            return [o.outputs[0].token_ids for o in outputs]

        def replays() -> int:
            stats = llm.collective_rpc("cuda_graph_stats")[0]
            assert stats["disabled"] is None, stats
            return stats["replays"]

        first, replayed = run(), replays()
        llm.update_weights()
        assert run() == first
        after_update = replays()
        llm.sleep(2)
        llm.wake_up()
        assert run() == first
        if DEVICE == "cuda":  # (wake_up's new KV cache makes new graphs: counted anew)
            assert replayed > 0 and after_update > replayed and replays() > 0
