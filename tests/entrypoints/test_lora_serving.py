"""``loom serve --enable-lora --lora-modules name=path``: adapters listed in /v1/models
with the base as parent, served by name with the offline API's text, an unknown name a
404 naming ``model``."""

from __future__ import annotations

import json

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


def test_adapters_load_and_unload_while_serving(case, tmp_path):
    """/v1/load_lora_adapter serves a new adapter by name at once; loading a name again
    (load_inplace) serves the new files (not the old ones' cached blocks), and so does
    /update_weights with lora_name while another adapter's request streams, which runs
    on as it would alone; /v1/unload_lora_adapter answers once the requests running with
    it have finished, and then the name is a 404; a bad adapter is a 400 naming
    lora_path."""
    import threading

    from loom_server import TINY_SERVER_ARGS, LoomServer

    base, paths = case
    make_adapter(base, str(tmp_path / "a2"), 2, 4, ["q_proj", "o_proj", "gate_proj"])
    with LLM(base, **ENGINE) as llm:
        texts = {name: llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, use_tqdm=False,
                                    lora_request=LoRARequest(name, 1, path))[0].outputs[0].text
                 for name, path in (("a1", paths["a1"]), ("a2", str(tmp_path / "a2")))}
        long_a2 = llm.generate({"prompt_token_ids": PROMPTS[0]},
                               GREEDY.clone(max_tokens=64), use_tqdm=False,
                               lora_request=LoRARequest("a2", 1, str(tmp_path / "a2"))
                               )[0].outputs[0].text
    server = LoomServer(base, *TINY_SERVER_ARGS, "--dtype", "float32", "--enable-lora",
                        "--max-loras", "2", "--max-lora-rank", "8",
                        "--enable-control-endpoints", "--served-model-name", "tiny")
    url = server.url

    def complete(model: str) -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})

    try:
        assert complete("a1").status_code == 404
        for name in ("a1", "a2"):
            loaded = httpx.post(url + "/v1/load_lora_adapter", timeout=60, json={
                "lora_name": name, "lora_path": paths.get(name, str(tmp_path / name))})
            assert loaded.status_code == 200, loaded.text
        assert complete("a1").json()["choices"][0]["text"] == texts["a1"]
        assert complete("a2").json()["choices"][0]["text"] == texts["a2"]
        # a1 again, from a2's files: a2's answer, none of a1's cached blocks
        again = httpx.post(url + "/v1/load_lora_adapter", timeout=60, json={
            "lora_name": "a1", "lora_path": str(tmp_path / "a2"), "load_inplace": True})
        assert again.status_code == 200, again.text
        assert complete("a1").json()["choices"][0]["text"] == texts["a2"]
        chunks: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "a2", "prompt": PROMPTS[0], "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as response:
                chunks.extend(line for line in response.iter_lines() if line.startswith("data:"))

        def streamed_text() -> str:
            return "".join(json.loads(line[5:])["choices"][0]["text"] for line in chunks
                           if line != "data: [DONE]")

        # a1's weights back from its own files while a2's request streams: a2 runs on
        streamer = threading.Thread(target=stream)
        streamer.start()
        while not chunks and streamer.is_alive():
            threading.Event().wait(0.01)
        updated = httpx.post(url + "/update_weights", timeout=60,
                             json={"lora_name": "a1", "path": paths["a1"]})
        streamer.join()
        assert updated.status_code == 200, updated.text
        assert streamed_text() == long_a2
        assert complete("a1").json()["choices"][0]["text"] == texts["a1"]
        for body, status, param in (({"lora_name": "a9", "path": paths["a1"]}, 404, "lora_name"),
                                    ({"lora_name": "a1", "path": str(tmp_path)}, 400, "path")):
            refused = httpx.post(url + "/update_weights", timeout=60, json=body)
            assert refused.status_code == status and refused.json()["error"]["param"] == param
        # unload while a long request streams with it: it finishes whole first
        chunks.clear()
        streamer = threading.Thread(target=stream)
        streamer.start()
        while not chunks and streamer.is_alive():
            threading.Event().wait(0.01)
        unloaded = httpx.post(url + "/v1/unload_lora_adapter", timeout=60,
                              json={"lora_name": "a2"})
        streamer.join()
        assert unloaded.status_code == 200 and chunks[-1] == "data: [DONE]"
        assert complete("a2").status_code == 404
        bad = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "x", "lora_path": str(tmp_path / "nothing")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        gone = httpx.post(url + "/v1/unload_lora_adapter", timeout=60, json={"lora_name": "x"})
        assert gone.status_code == 404
    finally:
        server.kill()


def test_gguf_adapters_served_and_loaded(case, tmp_path):
    """llama.cpp's LoRA GGUF (tests/e2e/test_lora_gguf.py) by --lora-modules and by
    /v1/load_lora_adapter: the PEFT directory's text; a GGUF that is not a LoRA adapter,
    one of another architecture and one holding a tensor loom cannot place are each a
    400 naming lora_path, with the reason in one line."""
    import gguf as gguf_py
    import numpy as np
    from e2e.test_lora_gguf import write_gguf_adapter
    from loom_server import TINY_SERVER_ARGS, LoomServer

    base, paths = case
    adapter = write_gguf_adapter(paths["a1"], str(tmp_path / "a1.gguf"))
    qwen = write_gguf_adapter(paths["a1"], str(tmp_path / "qwen.gguf"), arch="QWEN2")
    fused = write_gguf_adapter(paths["a1"], str(tmp_path / "fused.gguf"), extra={
        "blk.0.attn_qkv.weight.lora_a": np.zeros((8, 64), np.float32),
        "blk.0.attn_qkv.weight.lora_b": np.zeros((128, 8), np.float32)})
    model = gguf_py.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    model.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    for write in (model.write_header_to_file, model.write_kv_data_to_file,
                  model.write_tensors_to_file, model.close):
        write()
    with LLM(base, **ENGINE) as llm:
        text = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                            lora_request=LoRARequest("a1", 1, paths["a1"]))[0].outputs[0].text
    server = LoomServer(base, *TINY_SERVER_ARGS, "--dtype", "float32", "--enable-lora",
                        "--max-lora-rank", "8", "--lora-modules", f"g={adapter}",
                        "--enable-control-endpoints",
                        "--served-model-name", "tiny")

    def complete(model: str) -> str:
        answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    try:
        assert complete("g") == text
        loaded = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": "h", "lora_path": adapter})
        assert loaded.status_code == 200, loaded.text
        assert complete("h") == text
        for path, reason in ((tmp_path / "model.gguf", "not a LoRA adapter"),
                             (qwen, "converted for llama.cpp's 'qwen2' architecture"),
                             (fused, "holds blk.0.attn_qkv.weight.lora_a")):
            refused = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                                 json={"lora_name": "x", "lora_path": str(path)})
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == "lora_path", refused.text
            assert reason in error["message"] and "\n" not in error["message"]
        assert complete("g") == text
    finally:
        server.kill()
