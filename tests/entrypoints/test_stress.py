"""The stress harness's short run: rounds of the mixes that once wedged the
server (structured outputs beside plain requests, abort storms right after submission,
interleaved streaming and non-streaming, n > 1, draft-token speculation, preemption
from a small KV cache) under a CPU hog on the same cores; after every round the server
is empty again (running, waiting, engine requests, KV blocks in use, requests in flight
all 0) and its probe generates. The long run: benchmarks/stress.md."""

from __future__ import annotations

import asyncio
import random

from loom_server import LoomServer

from loom.bench.stress import CpuHog, soak, stress_round

ROUNDS = 3


def test_rounds_of_mixed_load_under_a_cpu_hog_leave_the_server_empty(tiny_model_dir):
    server = LoomServer(
        tiny_model_dir, "--max-model-len", "512", "--max-num-seqs", "16",
        "--num-gpu-blocks-override", "40",  # 640 tokens: long requests preempt each other
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_min": 1}')
    try:
        rng = random.Random(0)
        with CpuHog(2):
            for _ in range(ROUNDS):
                report = asyncio.run(stress_round(server.url, rng, size=32, max_tokens=16))
                assert not report.errors, report.errors
                assert report.completed and report.aborted
        assert server.metric("vllm:num_preemptions_total") > 0
        assert server.metric("vllm:spec_decode_num_draft_tokens_total") > 0
    finally:
        server.close()


def test_a_one_minute_soak_has_no_stuck_request_no_leak_and_flat_memory(tiny_model_dir):
    """The CI version of the 30-minute soak (benchmarks/soak.md), the same checks over one
    minute, memory sampled every 15 s: every request answered within 60 s, the empty
    state at the end, no process's RSS up 10% over the second half (the 30-minute run's
    stayed within 0.2% from its first minute on). The long drift is benchmarks/soak.py's."""
    server = LoomServer(tiny_model_dir, "--max-model-len", "512", "--max-num-seqs", "16",
                        "--kv-cache-memory", "64MiB")
    try:
        samples, report, stuck = asyncio.run(soak(
            server.url, server.proc.pid, minutes=1.0, concurrency=6, max_tokens=16,
            sample_s=15.0, request_timeout_s=60.0))  # ends with the empty-state check
        assert stuck == 0 and not report.errors, report.errors
        assert report.completed > 50
        assert set(samples[0].rss_mib) >= {"api", "engine-core", "worker-0"}
        warmed, last = samples[1], samples[-1]  # from second 30 on
        for role, rss in last.rss_mib.items():
            assert rss < warmed.rss_mib[role] * 1.10, (role, warmed.rss_mib, last.rss_mib)
    finally:
        server.close()
