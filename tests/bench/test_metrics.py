"""Metric math of `loom bench serve`, checked by hand against vLLM's definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loom.bench.metrics import (RequestResult, compute_metrics, format_table, meets_slos,
                                parse_goodput, summarize)


def result(ttft: float, itl: list[float], output_len: int, prompt_len: int = 10) -> RequestResult:
    return RequestResult(prompt_len=prompt_len, output_len=output_len, ttft=ttft,
                         latency=ttft + sum(itl), itl=itl, success=True)


def test_tpot_excludes_the_first_token():
    # 0.5 s to the first token, then 4 more tokens over 0.4 s -> 0.1 s per token.
    r = result(0.5, [0.1, 0.1, 0.1, 0.1], output_len=5)
    assert r.latency == pytest.approx(0.9)
    assert r.tpot == pytest.approx(0.1)


def test_tpot_counts_tokens_not_chunks():
    # Two chunks carrying 5 tokens: TPOT divides by output tokens - 1, not by chunks.
    r = result(0.2, [0.4], output_len=5)
    assert r.tpot == pytest.approx(0.1)


def test_tpot_is_undefined_for_one_token_or_a_failure():
    assert result(0.3, [], output_len=1).tpot is None
    assert RequestResult(prompt_len=3, error="HTTP 500").tpot is None


def test_compute_metrics_throughputs_and_stats():
    results = [result(0.1, [0.05] * 9, 10, prompt_len=20),
               result(0.3, [0.15] * 9, 10, prompt_len=30),
               RequestResult(prompt_len=99, error="HTTP 503: busy")]
    m = compute_metrics(results, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 50 and m["total_output_tokens"] == 20
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(10.0)
    assert m["total_token_throughput"] == pytest.approx(35.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_tpot_ms"] == pytest.approx(100.0)  # (50 + 150) / 2
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx((550 + 1650) / 2)
    assert m["errors"] == ["HTTP 503: busy"]
    assert "goodput" not in m
    table = format_table(m)
    assert "Successful requests:" in table and "P99 TPOT (ms):" in table


def test_percentiles_interpolate_linearly():
    values = list(range(1, 101))  # 1..100
    stats = summarize(values, [50, 99, 99.9])
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(np.percentile(values, 99)) == pytest.approx(99.01)
    assert stats["p99.9"] == pytest.approx(99.901)
    assert stats["median"] == stats["p50"]
    assert summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_goodput_counts_requests_meeting_every_slo():
    fast = result(0.1, [0.02] * 4, 5)       # ttft 100 ms, tpot 20 ms
    slow_start = result(0.9, [0.02] * 4, 5)  # ttft 900 ms
    slow_tokens = result(0.1, [0.2] * 4, 5)  # tpot 200 ms
    slos = parse_goodput(["ttft:500", "tpot:50"])
    assert slos == {"ttft": 0.5, "tpot": 0.05}
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_tokens)] == [True, False, False]
    m = compute_metrics([fast, slow_start, slow_tokens], duration_s=4.0, slos=slos)
    assert m["goodput"] == pytest.approx(0.25)
    assert m["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1000"]) == {"e2el": 1.0}


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "tpot:abc", "ttft:-1"])
def test_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_no_successes_gives_zeros_not_nans():
    m = compute_metrics([RequestResult(prompt_len=1, error="x")], duration_s=1.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in m.values())
