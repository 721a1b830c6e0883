"""Tokens routed per expert reach the engine's stats and /metrics, so that load
imbalance is visible: counted by bincount inside FusedMoE, shipped with each step's
output, added up by the scheduler, exported as loom:moe_expert_tokens_total{expert}
and loom:moe_expert_load_max_over_mean."""

from __future__ import annotations

import re

from checkpoints import FAVOURED, bias_router, make_tiny_checkpoint
from loom_server import TINY_SERVER_ARGS, LoomServer
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.core.wire import SchedulerStats
from loom.metrics import ServerMetrics

# qwen3_moe in checkpoints.py: 2 layers, each a MoE of 8 experts, top-2
NUM_MOE_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2


def _checkpoint(tmp_path) -> str:
    path = bias_router(make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe"))
    make_tiny_tokenizer(path)
    return path


def test_engine_stats_count_every_routed_token(tmp_path):
    """Three prompts (no prefix cache, no preemption): every forwarded token is
    counted once per layer and chosen expert, and the favoured experts lead."""
    llm = LLM(_checkpoint(tmp_path), dtype="float32", max_model_len=128,
              enable_prefix_caching=False, max_num_batched_tokens=16, enable_warm_up=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 41)]
    max_tokens = 6
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.engine_core.get_stats()
    llm.shutdown()
    assert stats.num_preemptions == 0
    # each prompt's tokens, then each new token but the last, went through the model
    forwarded = sum(len(p) + max_tokens - 1 for p in prompts)
    assert len(stats.expert_tokens) == NUM_EXPERTS
    assert sum(stats.expert_tokens) == forwarded * NUM_MOE_LAYERS * TOP_K
    busiest = sorted(range(NUM_EXPERTS), key=stats.expert_tokens.__getitem__)[-2:]
    assert sorted(busiest) == sorted(FAVOURED), stats.expert_tokens

    metrics = ServerMetrics("m")
    metrics.record_scheduler_stats(stats)
    text = metrics.render().decode()
    for expert, count in enumerate(stats.expert_tokens):
        assert (f'loom:moe_expert_tokens_total{{expert="{expert}",model_name="m",replica="0"}} '
                f'{float(count)}') in text
    mean = sum(stats.expert_tokens) / NUM_EXPERTS
    gauge = metrics.registry.get_sample_value("loom:moe_expert_load_max_over_mean",
                                              {"model_name": "m", "replica": "0"})
    assert gauge == max(stats.expert_tokens) / mean > 1.5


def test_metrics_counters_grow_by_each_report():
    metrics = ServerMetrics("m")
    metrics.record_scheduler_stats(SchedulerStats(0, 0, 0.0, 0, 0, 0, expert_tokens=[4, 0]))
    metrics.record_scheduler_stats(SchedulerStats(0, 0, 0.0, 0, 0, 0, expert_tokens=[6, 2]))
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "m", "replica": "0"}
    assert sample("loom:moe_expert_tokens_total", {**labels, "expert": "0"}) == 6
    assert sample("loom:moe_expert_tokens_total", {**labels, "expert": "1"}) == 2
    assert sample("loom:moe_expert_load_max_over_mean", {"model_name": "m", "replica": "0"}) == 1.5
    dense = ServerMetrics("d")
    dense.record_scheduler_stats(SchedulerStats(0, 0, 0.0, 0, 0, 0))
    assert "loom:moe_expert_tokens_total{" not in dense.render().decode()


def test_server_metrics_show_tokens_per_expert(tmp_path):
    """A real `loom serve` of the biased MoE: after one completion, /metrics holds a
    counter per expert whose sum is every forwarded token x layers x top-k."""
    server = LoomServer(_checkpoint(tmp_path), *TINY_SERVER_ARGS, "--no-enable-prefix-caching",
                        "--no-enable-warm-up")
    try:
        reply = server.openai().completions.create(model=server.http().get(
            "/v1/models").json()["data"][0]["id"], prompt="hello experts", max_tokens=5,
            extra_body={"ignore_eos": True})
        usage = reply.usage
        forwarded = usage.prompt_tokens + usage.completion_tokens - 1
        text = server.http().get("/metrics").text
        counts = {int(e): float(v) for e, v in re.findall(
            r'loom:moe_expert_tokens_total\{expert="(\d+)",model_name="[^"]*",replica="0"\} (\S+)',
            text)}
        assert sorted(counts) == list(range(NUM_EXPERTS))
        assert sum(counts.values()) == forwarded * NUM_MOE_LAYERS * TOP_K
        assert server.metric("loom:moe_expert_load_max_over_mean") > 1.5
    finally:
        server.terminate()
