"""``loom serve --enable-lora --lora-modules name=path``: adapters listed in /v1/models
with the base as parent, served by name with the offline API's text, an unknown name a
404 naming ``model``."""

from __future__ import annotations

import httpx
import pytest
from checkpoints import make_tiny_checkpoint
from e2e.test_lora import ENGINE, GREEDY, PROMPTS, make_adapter
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, LoRARequest


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serving")
    base = make_tiny_tokenizer(make_tiny_checkpoint("llama", root / "base"))
    make_adapter(base, str(root / "a1"), 1, 8, ["q_proj", "v_proj", "down_proj"])
    return base, {"a1": str(root / "a1")}


def test_the_server_serves_adapters_by_name(case):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    base, paths = case
    with LLM(base, **ENGINE) as llm:  # the offline answers to compare with
        texts = {name: llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                                    lora_request=LoRARequest(name, 1, paths[name])
                                    if name else None)[0].outputs[0].text
                 for name in ("a1", None)}
    server = LoomServer(base, *TINY_SERVER_ARGS, "--dtype", "float32", "--enable-lora",
                        "--max-lora-rank", "8", "--lora-modules", f"a1={paths['a1']}",
                        "--served-model-name", "tiny")
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a1", "tiny")]
        client = server.openai()
        for model, name in (("a1", "a1"), ("tiny", None)):
            answer = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert answer.choices[0].text == texts[name], model
        assert texts["a1"] != texts[None]
        missing = httpx.post(server.url + "/v1/completions", timeout=30,
                             json={"model": "a2", "prompt": "hi"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    finally:
        server.kill()
