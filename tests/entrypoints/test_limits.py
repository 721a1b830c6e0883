"""The API key and the waiting-queue cap, on one server:
--api-key, --max-num-seqs 1, --max-num-waiting 1."""

from __future__ import annotations

import httpx
import openai
import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--max-num-seqs", "1",
                        "--max-num-waiting", "1", api_key=KEY)
    yield server
    assert server.terminate() == 0, server.output()


def test_api_key_guards_every_route_but_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            response = http.request(method, path, json={})
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
            wrong = http.request(method, path, json={},
                                 headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert server.openai().models.list().data


def test_queue_cap_answers_503_with_retry_after(server):
    body = {"prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with server.http() as first_client, server.http() as second_client:
        # one runs (max_num_seqs 1), one waits (max_num_waiting 1) ...
        with first_client.stream("POST", "/v1/completions", json=body) as first, \
                second_client.stream("POST", "/v1/completions", json=body) as second:
            assert first.status_code == second.status_code == 200
            # ... and a third may not wait
            with server.http() as http:
                rejected = http.post("/v1/completions", json={**body, "stream": False})
            assert rejected.status_code == 503
            assert rejected.headers["retry-after"] == "1"
            assert rejected.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.APIStatusError) as info:
                server.openai().completions.create(model=None, prompt="x", max_tokens=1)
            assert info.value.status_code == 503
    # the two streams are gone: room again
    assert server.wait_for_metric("vllm:num_requests_running", 0, timeout=5) == 0
    out = server.openai().completions.create(model=None, prompt="x", max_tokens=2,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    # n counts: three sequences are one running and two waiting, over the cap
    with server.http() as http:
        too_many = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3})
    assert too_many.status_code == 503
