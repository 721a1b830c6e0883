"""`loom bench serve` against a real tiny `loom serve`; `loom bench throughput | latency`
on the tiny model in this process; all three with n-gram speculation on copy prompts."""

from __future__ import annotations

import json

import pytest
from entrypoints.loom_server import TINY_SERVER_ARGS, LoomServer

from loom.cli import main

TINY_ENGINE_ARGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", "tiny",
                        "--disable-log-requests")
    yield server
    assert server.terminate() == 0, server.output()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_against_loom_serve(server, tiny_model_dir, tmp_path, capsys, endpoint):
    result_file = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server.url, "--endpoint", endpoint,
                 "--tokenizer", tiny_model_dir, "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "8",
                 "--request-rate", "50", "--max-concurrency", "2",
                 "--goodput", "ttft:60000", "tpot:60000", "--disable-tqdm",
                 "--result-file", str(result_file), "--save-detailed"])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    record = json.loads(result_file.read_text())
    assert record["model"] == "tiny"  # from GET /v1/models
    assert record["completed"] == 4 and record["failed"] == 0
    assert record["total_output_tokens"] == 32  # ignore_eos: exactly max_tokens each
    assert record["requests_with_other_output_len"] == 0
    assert record["goodput"] == pytest.approx(record["request_throughput"])
    assert 0 < record["mean_ttft_ms"] <= record["mean_e2el_ms"]
    assert record["median_tpot_ms"] > 0 and record["p99_itl_ms"] > 0
    assert all(len(itl) >= 1 for itl in record["itls"])
    if endpoint == "/v1/completions":
        assert record["total_input_tokens"] == 4 * 16


def test_bench_serve_reports_a_dead_server(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
                 "--disable-tqdm", "--request-timeout", "5"]) == 2
    assert "is the server up?" in capsys.readouterr().err


def test_bench_throughput_and_latency(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-prompts", "6",
                 "--input-len", "16", "--output-len", "8", "--random-range-ratio", "0.5",
                 "--disable-tqdm", "--result-file", str(out), *TINY_ENGINE_ARGS]) == 0
    record = json.loads(out.read_text())
    assert record["num_prompts"] == 6 and record["output_tokens_per_s"] > 0
    assert 6 * 4 <= record["total_output_tokens"] <= 6 * 12

    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_model_dir, "--batch-size", "1", "2",
                 "--input-len", "16", "--output-len", "6", "--num-iters", "2",
                 "--num-iters-warmup", "1", "--result-file", str(out), *TINY_ENGINE_ARGS]) == 0
    one, two = json.loads(out.read_text())["results"]
    assert (one["batch_size"], two["batch_size"]) == (1, 2)
    assert two["median_prefill_s"] > 0 and two["median_decode_step_s"] > 0
    assert two["decode_tokens_per_step"] == 2
    assert two["decode_tokens_per_s"] == pytest.approx(2 / two["median_decode_step_s"])
    assert "spec_decode_acceptance_rate" not in two


def _check_spec_decode(record):
    assert record["spec_decode_num_draft_tokens"] > 0 and record["spec_decode_num_drafts"] > 0
    assert 0 <= record["spec_decode_acceptance_rate"] <= 1
    assert record["spec_decode_acceptance_length"] == pytest.approx(
        1 + record["spec_decode_num_accepted_tokens"] / record["spec_decode_num_drafts"])


def test_bench_throughput_and_latency_with_speculation(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dataset-name", "repeat",
                 "--num-prompts", "3", "--input-len", "96", "--output-len", "16",
                 "--speculative-config", NGRAM, "--disable-tqdm", "--result-file", str(out),
                 *TINY_ENGINE_ARGS]) == 0
    record = json.loads(out.read_text())
    assert record["dataset_name"] == "repeat" and record["speculative_config"]["method"] == "ngram"
    assert record["total_output_tokens"] == 3 * 16
    _check_spec_decode(record)
    assert "Speculative decoding:" in capsys.readouterr().out

    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_model_dir, "--dataset-name", "repeat",
                 "--batch-size", "2", "--input-len", "96", "--output-len", "16",
                 "--num-iters", "2", "--speculative-config", NGRAM, "--result-file", str(out),
                 *TINY_ENGINE_ARGS]) == 0
    (result,) = json.loads(out.read_text())["results"]
    _check_spec_decode(result)
    assert result["decode_tokens_per_step"] >= 1  # tokens of the batch, with accepted drafts
    assert result["decode_tokens_per_s"] == pytest.approx(
        result["decode_tokens_per_step"] / result["median_decode_step_s"])


def test_bench_serve_against_loom_serve_with_speculation(tiny_model_dir, tmp_path, capsys):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--speculative-config", NGRAM,
                        "--disable-log-requests")
    try:
        result_file = tmp_path / "serve.json"
        code = main(["bench", "serve", "--base-url", server.url,
                     "--endpoint", "/v1/chat/completions", "--dataset-name", "repeat",
                     "--tokenizer", tiny_model_dir, "--num-prompts", "3",
                     "--random-input-len", "96", "--random-output-len", "16",
                     "--disable-tqdm", "--result-file", str(result_file)])
    finally:
        assert server.terminate() == 0, server.output()
    assert code == 0
    assert "Speculative Decoding" in capsys.readouterr().out
    record = json.loads(result_file.read_text())
    assert record["completed"] == 3 and record["total_output_tokens"] == 3 * 16
    _check_spec_decode(record)
