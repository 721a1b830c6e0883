"""`loom serve --speculative-config ... --early-stop-config ...` on the tiny model:
completions with ``echo`` + ``logprobs`` return the prompt's logprobs (equal to
transformers'), streamed or not; greedy text equals that of a server without
speculation; acceptance counters and early stop show through the API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from loom_server import TINY_SERVER_ARGS, LoomServer

MODEL = "tiny"
PROMPT = [40 + i % 5 for i in range(30)]  # repetitive: n-gram drafts get accepted


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests", "--max-num-batched-tokens", "16",
                        "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                        "--early-stop-config",
                        '{"enable_early_stop": true, "window_size": 5, "threshold": 0.99}')
    yield server
    assert server.terminate() == 0, server.output()


def complete(server, **body) -> dict:
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_returns_prompt_logprobs(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = complete(server, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2,
                   ignore_eos=True)
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 5
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for position, token_id in enumerate(PROMPT[1:]):
        assert logprobs["token_logprobs"][position + 1] == pytest.approx(
            float(expected[position, token_id]), abs=1e-3)
        assert len(logprobs["top_logprobs"][position + 1]) in (2, 3)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])

    # streamed: the same tokens and logprobs, the prompt's in the first chunk
    with server.http() as http, http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True,
            "logprobs": 2, "ignore_eos": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    streamed = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert len(streamed[0]["tokens"]) > len(PROMPT) - 1
    assert sum((lp["token_logprobs"] for lp in streamed), []) == logprobs["token_logprobs"]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == out["choices"][0]["text"]


def test_greedy_text_equals_a_server_without_speculation(server, tiny_model_dir):
    body = dict(prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    accepted_before = server.metric("vllm:spec_decode_num_accepted_tokens_total")
    with_spec = complete(server, **body)["choices"][0]["text"]
    assert server.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted_before
    assert server.metric("vllm:spec_decode_num_draft_tokens_total") >= \
        server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert server.metric("vllm:spec_decode_num_drafts_total") > 0
    plain = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                       "--disable-log-requests")
    try:
        assert complete(plain, **body)["choices"][0]["text"] == with_spec
    finally:
        plain.close()


def test_early_stop_reported(server):
    out = complete(server, prompt="hello", max_tokens=40, logit_bias={"77": 100},
                   ignore_eos=True)
    choice = out["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "early_stop")
    assert out["usage"]["completion_tokens"] == 5


def test_bad_speculative_config_fails_fast(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "loom.cli", "serve", tiny_model_dir,
                             "--speculative-config", '{"method": "medusa"}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "speculative method must be one of ngram, draft_model" in result.stderr
