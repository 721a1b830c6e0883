"""llama.cpp's LoRA GGUF adapters (convert_lora_to_gguf.py) wherever a PEFT directory is
taken (--lora-modules, an offline LoRARequest, /v1/load_lora_adapter: the server's in
tests/entrypoints/test_lora_serving.py): greedy tokens equal the same adapter's PEFT
directory and PEFT's merged model (float32), on a Hugging Face base and on the base's
own GGUF, with each pair's scale llama.cpp's alpha / r; a GGUF that is not a LoRA
adapter, one of another architecture, a tensor loom cannot place and a rank above
--max-lora-rank are each one line naming the adapter.

The adapters are written here with the ``gguf`` package as the converter writes them
(its ``LoraModel``: ``general.type`` adapter, ``adapter.type`` lora,
``adapter.lora.alpha``, ``<tensor>.lora_a`` (r, in) and ``.lora_b`` (out, r) under
gguf-py's own name map, llama's Q and K permuted, the token embeddings' A transposed):
the converter itself needs a llama.cpp checkout. benchmarks/lora_speed.py --llama-cpp
converts with the real one and checks loom's tokens with it against the PEFT
directory's."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from checkpoints import make_tiny_checkpoint
from e2e.test_lora import (ALL, ENGINE, PROMPTS, generate, hf_greedy, make_adapter,
                           make_shared_experts_case)
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, LoRARequest

TABLES = ALL + ["embed_tokens", "lm_head"]


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for the llama architecture (LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf_adapter(adapter: str, path: str, arch: str = "LLAMA", dtype=np.float32,
                       extra: dict[str, np.ndarray] | None = None) -> str:
    """The PEFT directory ``adapter`` as convert_lora_to_gguf.py writes it, for llama.cpp
    architecture ``arch`` (a gguf.MODEL_ARCH name); ``extra``: more tensors, by name."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        lora_config = json.load(f)
    with open(os.path.join(lora_config["base_model_name_or_path"], "config.json")) as f:
        config = json.load(f)
    model_arch = getattr(gguf.MODEL_ARCH, arch)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora_config["lora_alpha"]))
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(os.path.join(adapter, "adapter_model.safetensors")).items():
        module, _, half = key.removeprefix("base_model.model.").removesuffix(".weight") \
            .rpartition(".")
        pairs.setdefault(module + ".weight", {})[half[-1]] = tensor  # A or B
    for module, pair in pairs.items():
        a, b = pair["A"], pair["B"]
        if model_arch == gguf.MODEL_ARCH.LLAMA and module.endswith(("q_proj.weight",
                                                                   "k_proj.weight")):
            b = _permute(b, config["num_attention_heads"] if "q_proj" in module
                         else config["num_key_value_heads"])
        name = names.get_name(module, try_suffixes=(".weight",))
        assert name is not None, module
        if name == "token_embd.weight":  # llm_build_inp_embd gathers A's rows
            a = a.t()
        writer.add_tensor(name + ".lora_a", a.float().numpy().astype(dtype))
        writer.add_tensor(name + ".lora_b", b.float().numpy().astype(dtype))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    """A llama base, a rank-8 PEFT adapter on every linear, the embeddings and the LM
    head, that adapter as a GGUF (float32 and float16), and PEFT's merged tokens."""
    root = tmp_path_factory.mktemp("lora_gguf")
    base = make_tiny_tokenizer(make_tiny_checkpoint("llama", root / "base"))
    peft = str(root / "peft")
    merged = make_adapter(base, peft, 5, 8, TABLES)
    gguf = write_gguf_adapter(peft, str(root / "adapter.gguf"))
    half = write_gguf_adapter(peft, str(root / "adapter-f16.gguf"), dtype=np.float16)
    return base, peft, gguf, half, [hf_greedy(merged, p) for p in PROMPTS]


def test_a_gguf_adapter_gives_its_peft_directorys_tokens(gguf_case):
    """--lora-modules and an offline LoRARequest with the .gguf: PEFT's merged tokens, as
    the directory gives them, in a batch with the directory's adapter and the base; a
    float16 file gives the same tokens."""
    base, peft, gguf, half, want = gguf_case
    with LLM(base, **ENGINE | {"lora_modules": [f"g={gguf}"]}) as llm:
        assert generate(llm, LoRARequest("g", 1, gguf)) == want
        mixed = generate(llm, [LoRARequest("g", 1, gguf), None, LoRARequest("p", 2, peft)])
        plain = generate(llm, None)
        assert generate(llm, LoRARequest("h", 3, half)) == want
    assert mixed == [want[0], plain[1], want[2]] and plain != want


def test_a_gguf_adapter_on_a_gguf_base(gguf_case, tmp_path):
    """The llama.cpp pairing: the base's own GGUF (Q and K permuted in both files) with
    the adapter's GGUF gives the PEFT directory's tokens on the checkpoint."""
    from model.test_moe_gguf import write_gguf

    base, _, gguf, _, want = gguf_case
    base_gguf = write_gguf(base, str(tmp_path / "base.gguf"), "llama")
    with LLM(base_gguf, skip_tokenizer_init=True, **ENGINE) as llm:
        assert generate(llm, LoRARequest("g", 1, gguf)) == want


@pytest.fixture(scope="module")
def shared_experts_case(tmp_path_factory):
    return make_shared_experts_case(tmp_path_factory.mktemp("shared_experts"))


def test_a_gguf_adapter_on_shared_experts(shared_experts_case, tmp_path):
    """ERNIE 4.5 MoE's (ernie4_5-moe: no rows permuted, the shared experts' ffn_*_shexp):
    PEFT's merged tokens, as the directory gives them."""
    base, shared, _, want = shared_experts_case
    gguf = write_gguf_adapter(shared, str(tmp_path / "shared.gguf"), arch="ERNIE4_5_MOE")
    with LLM(base, **ENGINE) as llm:
        assert generate(llm, LoRARequest("g", 1, gguf)) == want


def test_the_scale_is_llama_cpps_alpha_over_rank(gguf_case):
    """Each B carries alpha / r (PEFT's lora_alpha 16, r 8), Q's rows back in the
    checkpoint's order, the embeddings' A back to PEFT's (r, V)."""
    from safetensors.torch import load_file

    from loom.model.loader import load_hf_config
    from loom.model.loader.gguf_loader import gguf_lora_weights

    base, peft, gguf, _, _ = gguf_case
    got = gguf_lora_weights(gguf, load_hf_config(base), "LlamaForCausalLM")
    want = {key: tensor for key, tensor in
            load_file(os.path.join(peft, "adapter_model.safetensors")).items()
            if ".base_layer." not in key}  # PEFT's copies of the tables, not the adapter's
    assert set(got) == set(want)
    for key in ("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight",
                "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight",
                "base_model.model.lm_head.lora_B.weight",
                "base_model.model.model.embed_tokens.lora_embedding_B"):
        torch.testing.assert_close(got[key], want[key] * 2.0)
    for key in ("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
                "base_model.model.model.embed_tokens.lora_embedding_A"):
        torch.testing.assert_close(got[key], want[key])


def test_gguf_files_loom_cannot_serve_are_refused_in_one_line(gguf_case, tmp_path):
    """Not a LoRA adapter (a model's GGUF; not GGUF at all), another architecture's
    adapter, a rank above --max-lora-rank: refused at start-up; another architecture's
    adapter and a tensor loom cannot place named by a request: its error, and the engine
    serves on."""
    import gguf as gguf_py

    base, peft, gguf, _, want = gguf_case
    qwen = write_gguf_adapter(peft, str(tmp_path / "qwen.gguf"), arch="QWEN2")
    other_arch = (r"converted for llama.cpp's 'qwen2' architecture; this base "
                  r"\(LlamaForCausalLM\) is 'llama'")
    model = gguf_py.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    model.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    for write in (model.write_header_to_file, model.write_kv_data_to_file,
                  model.write_tensors_to_file, model.close):
        write()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    for path, match in ((tmp_path / "model.gguf", r"is a GGUF model \(general.type\), not a "
                                                  "LoRA adapter"),
                        (junk, "neither a PEFT adapter directory nor a readable GGUF file"),
                        (gguf, "rank 8, above --max-lora-rank 4"),
                        (qwen, other_arch)):
        with pytest.raises(ValueError, match=match) as refused:
            LLM(base, **ENGINE | {"max_lora_rank": 4 if path == gguf else 8,
                                  "lora_modules": [f"x={path}"]})
        assert "\n" not in str(refused.value)
    fused = write_gguf_adapter(peft, str(tmp_path / "fused.gguf"), extra={
        "blk.0.attn_qkv.weight.lora_a": np.zeros((8, 64), np.float32),
        "blk.0.attn_qkv.weight.lora_b": np.zeros((128, 8), np.float32)})
    with LLM(base, **ENGINE) as llm:
        for path, match in ((qwen, other_arch),
                            (fused, "holds blk.0.attn_qkv.weight.lora_a, which loom cannot "
                                    "place on a llama model")):
            with pytest.raises(ValueError, match=match) as refused:
                generate(llm, LoRARequest("x", 1, path))
            assert "\n" not in str(refused.value)
        assert generate(llm, LoRARequest("g", 1, gguf)) == want
