"""CUDA graphs' verification and mixed steps on a GPU, against the same engine eager.

loom/worker/cuda_graphs.py replays more than pure decode steps: under speculative
decoding a step whose every request runs its last token and k drafts (a verification
step, captured per (batch, context, k + 1)), and on the Triton attention backend a step
of prefill chunks beside decodes (a mixed step, captured per token bucket). On the CPU
these are proven uncaptured only (tests/worker/test_cuda_graphs.py, ``capture=False``).
Here a tiny Llama runs them on CUDA with graphs on, float32 greedy: its tokens must equal
the same engine's with ``enforce_eager=True``, and ``Worker.cuda_graph_stats`` must show
the steps captured (a captured graph computes its step by replaying: the capture itself
runs nothing, and the warm-up's K/V is written again by the replay).

Runs only with ``LOOM_TEST_DEVICE=cuda`` on a machine with CUDA
(``benchmarks/cuda_check.sh``, step ``graph_steps``); skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_spec_decode import make_prompts, one_layer_copy

from loom import LLM, SamplingParams

DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE != "cuda" or not torch.cuda.is_available(),
    reason="CUDA graphs are captured on a GPU only: needs LOOM_TEST_DEVICE=cuda and CUDA "
           "(benchmarks/cuda_check.sh)")

MAX_NEW_TOKENS = 16
NUM_DRAFTS = 3


def greedy(llm: LLM) -> list[list[int]]:
    """Eight prompts of 1-130 tokens, most repeating a short pattern, batched."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params,
                           use_tqdm=False)
    assert not llm.engine.engine_core.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outputs]


def graph_stats(llm: LLM) -> dict:
    stats = llm.collective_rpc("cuda_graph_stats")[0]
    print(f"CUDA graphs: {stats}")
    assert stats["made"] and stats["disabled"] is None, stats  # no capture failed
    return stats


def graph_stats_off(llm: LLM) -> bool:
    """The eager engine made no graphs (``enforce_eager``)."""
    stats = llm.collective_rpc("cuda_graph_stats")[0]
    return not stats["made"] and stats["replays"] == 0


def graphs_ran_again(graphs: dict) -> bool:
    """More steps replayed than graphs captured: graphs replayed after their capture."""
    return graphs["replays"] > len(graphs["captured"]) + len(graphs["mixed_captured"])


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_verification_steps_replayed_give_the_eager_tokens(tiny_llama, tmp_path,
                                                           attention_backend):
    """Draft-model speculation (the tiny Llama cut to one layer: its drafts are accepted
    in part), 3 drafts a request: every verification step runs 4 tokens a request, so
    it is captured per (batch, context, 4) and replayed. Greedy tokens equal the eager
    engine's, token for token."""
    draft = one_layer_copy(tiny_llama, str(tmp_path / "draft"))
    spec = {"method": "draft_model", "num_speculative_tokens": NUM_DRAFTS, "model": draft}
    kwargs = dict(device="cuda", dtype="float32", max_model_len=256, seed=0,
                  attention_backend=attention_backend, speculative_config=spec)
    with LLM(tiny_llama, enforce_eager=True, **kwargs) as llm:
        eager = greedy(llm)
        assert graph_stats_off(llm)
    with LLM(tiny_llama, **kwargs) as llm:
        replayed = greedy(llm)
        stats = llm.engine.engine_core.get_stats()
        graphs = graph_stats(llm)
    for i, (r, e) in enumerate(zip(replayed, eager)):
        assert r == e, f"prompt {i}: with CUDA graphs {r} != eager {e}"
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    verification = [b for b in graphs["captured"] if b[2] == NUM_DRAFTS + 1]
    assert verification, f"no verification step was captured: {graphs}"
    assert graphs_ran_again(graphs), graphs


def test_mixed_steps_replayed_give_the_eager_tokens(tiny_llama):
    """``--attention-backend triton`` with chunked prefill (32 tokens a step): the
    prompts of 1-130 tokens prefill over several steps, the short ones decoding beside
    the long ones' chunks, so those steps mix prefill chunks and decodes; each is
    captured per token bucket (16, 32) and replayed. Greedy tokens equal the eager
    engine's."""
    kwargs = dict(device="cuda", dtype="float32", max_model_len=256, seed=0,
                  attention_backend="triton", max_num_batched_tokens=32)
    with LLM(tiny_llama, enforce_eager=True, **kwargs) as llm:
        eager = greedy(llm)
        assert graph_stats_off(llm)
    with LLM(tiny_llama, **kwargs) as llm:
        replayed = greedy(llm)
        graphs = graph_stats(llm)
    for i, (r, e) in enumerate(zip(replayed, eager)):
        assert r == e, f"prompt {i}: with CUDA graphs {r} != eager {e}"
    assert graphs["mixed_captured"], f"no mixed step was captured: {graphs}"
    assert set(graphs["mixed_captured"]) <= {16, 32}, graphs
    # the decode steps after the last prefill chunk
    assert graphs["captured"], f"no decode step was captured: {graphs}"
    assert graphs_ran_again(graphs), graphs

