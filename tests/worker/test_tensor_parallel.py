"""TP=2 in worker processes gives the greedy tokens of TP=1 and of transformers, for
each family, with chunked prefill and prefix caching on."""

from __future__ import annotations

import pytest
import torch

from checkpoints import FAMILIES
from loom import LLM, SamplingParams

from .helpers import executor_of, make_model_dir

SHARED_PREFIX = list(range(3, 40))  # 37 tokens: two full blocks of 16 to share
PROMPTS = [SHARED_PREFIX + [50, 51], [7, 8, 9], SHARED_PREFIX + [60], list(range(100, 130))]
MAX_TOKENS = 8
# Chunked prefill: a 39-token prompt takes three steps of at most 16 tokens.
ENGINE_KWARGS = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
                     enable_prefix_caching=True, num_gpu_blocks_override=64, dtype="float32")


def transformers_greedy(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 pad_token_id=0, eos_token_id=None)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def loom_greedy(path: str, **kwargs) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Tokens of a cold run and of a repeat run (prefix-cache hits), cached counts."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, **ENGINE_KWARGS, **kwargs) as llm:
        cold = llm.generate(prompts, params, use_tqdm=False)
        warm = llm.generate(prompts, params, use_tqdm=False)
        if kwargs.get("tensor_parallel_size", 1) > 1:
            assert type(executor_of(llm)).__name__ == "MultiProcExecutor"
    return ([o.outputs[0].token_ids for o in cold], [o.outputs[0].token_ids for o in warm],
            [o.num_cached_tokens for o in warm])


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_matches_tp1_and_transformers(tmp_path, family):
    path = make_model_dir(family, tmp_path / family)
    expected = transformers_greedy(path)
    tp1_cold, tp1_warm, _ = loom_greedy(path)
    tp2_cold, tp2_warm, cached = loom_greedy(path, tensor_parallel_size=2)
    assert tp1_cold == expected
    assert tp1_warm == expected
    assert tp2_cold == expected
    assert tp2_warm == expected
    assert cached[0] >= 32  # the shared prefix came from the cache
