"""GGUF files of the MoE and ERNIE families, as llama.cpp's converter writes them
(architectures qwen3moe, ernie4_5, ernie4_5-moe): loom reads their config from the
metadata and their tensors (experts stacked per projection, the router, shared experts,
the correction bias) under Hugging Face names, and gives transformers' greedy tokens on
the checkpoint the file was written from.

The files are written here with the ``gguf`` package (a loom dependency), with the
tensor names of its own ``TensorNameMap`` (the converter's) and the metadata keys the
converter writes (convert_hf_to_gguf.py: TextModel.set_gguf_parameters, plus
Ernie4_5MoeModel's; the vocabulary as ``_set_vocab_sentencepiece`` lays it out, its
tokens placeholders): the converter itself needs a llama.cpp checkout and a real
tokenizer, which CI does not have. benchmarks/ernie_gguf_converter.py runs the real
converter on ERNIE 4.5 checkpoints with a trained SentencePiece tokenizer (loom's tokens
and tokenizer equal transformers') and checks that this writer writes the same keys,
tensor names and values; benchmarks/moe_speed.py runs it on a Qwen3-MoE checkpoint."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from e2e.test_llm_correctness import hf_greedy, make_prompts

from loom import LLM, SamplingParams
from loom.kernels import native_ops
from loom.model.loader import load_hf_config

from .checkpoints import make_tiny_checkpoint

GGUF_ARCH = {"qwen3_moe": "QWEN3MOE", "ernie4_5": "ERNIE4_5", "ernie4_5_moe": "ERNIE4_5_MOE",
             "mixtral": "LLAMA"}  # llama.cpp writes Mixtral as llama with experts
_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\."
                     r"(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for the llama architecture (LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(checkpoint: str, path: str, family: str) -> str:
    """``checkpoint`` as llama.cpp's converter would write it, tensors in float32
    (``family`` one of ``GGUF_ARCH``, or ``llama``)."""
    import gguf
    from safetensors.torch import load_file

    config = load_hf_config(checkpoint).to_dict()
    config |= {"num_experts": getattr(load_hf_config(checkpoint), "num_experts", None)}
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH.get(family) or {"llama": "LLAMA"}[family])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    num_layers = config["num_hidden_layers"]
    writer.add_block_count(num_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # the converter's vocabulary keys (no vocab_size: the token list gives it)
    specials = {config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]}
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"<t{i}>" for i in range(config["vocab_size"])])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(config["vocab_size"])])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if family == "mixtral":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if family == "qwen3_moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if family == "ernie4_5_moe":
        writer.add_expert_count(config["moe_num_experts"])
        writer.add_expert_used_count(config["moe_k"])
        writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
        writer.add_leading_dense_block_count(config["moe_layer_start_index"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["moe_num_shared_experts"])
        # as the converter: intermediate_size // num_key_value_heads (loom reads neither)
        writer.add_expert_shared_feed_forward_length(
            config["intermediate_size"] // config["num_key_value_heads"])
    names = gguf.get_tensor_name_map(arch, num_layers)
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if m := _EXPERT.match(name):  # the converter stacks each projection's experts
            stacked.setdefault(f"{m['layer']}.{m['proj']}", {})[int(m["e"])] = tensor
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _permute(tensor, config["num_attention_heads"] if "q_proj" in name
                              else config["num_key_value_heads"])
        # as the converter's filter_tensors: the correction bias maps by ".bias"
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.float().numpy())
    for name, experts in stacked.items():
        whole = torch.stack([experts[e] for e in range(len(experts))]).float().numpy()
        writer.add_tensor(names.get_name(name + ".weight", try_suffixes=(".weight",)), whole)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_file_gives_transformers_tokens(tmp_path, family):
    from transformers import AutoModelForCausalLM

    checkpoint = make_tiny_checkpoint(family, tmp_path / family)
    path = write_gguf(checkpoint, str(tmp_path / f"{family}.gguf"), family)
    hf_config, gguf_config = load_hf_config(checkpoint), load_hf_config(path)
    assert gguf_config.architectures == hf_config.architectures
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    assert (getattr(gguf_config, "head_dim", None) or head_dim) == \
        (getattr(hf_config, "head_dim", None) or head_dim)
    for field in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "num_experts", "moe_intermediate_size",
                  "num_experts_per_tok", "norm_topk_prob", "moe_num_experts", "moe_k",
                  "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
                  "use_bias", "num_local_experts"):
        assert getattr(gguf_config, field, None) == getattr(hf_config, field, None), field
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size)[2:10:2]
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 6) for prompt in prompts]
    llm = LLM(path, dtype="float32", max_model_len=256, skip_tokenizer_init=True,
              enable_warm_up=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_stacked_experts_split_per_expert(tmp_path):
    """The loader's view of a stacked expert tensor: one HF tensor per expert."""
    from loom.model.loader.gguf_loader import gguf_to_hf_name, gguf_weights_iterator

    assert gguf_to_hf_name("blk.1.ffn_gate_inp.weight", "qwen3moe") == \
        "model.layers.1.mlp.gate.weight"
    assert gguf_to_hf_name("blk.1.exp_probs_b.bias", "ernie4_5-moe") == \
        "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    assert gguf_to_hf_name("blk.1.ffn_up_shexp.weight", "ernie4_5-moe") == \
        "model.layers.1.mlp.shared_experts.up_proj.weight"
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "q")
    path = write_gguf(checkpoint, str(tmp_path / "q.gguf"), "qwen3_moe")
    weights = dict(gguf_weights_iterator(path, load_hf_config(path)))
    from safetensors.torch import load_file

    original = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert set(weights) == set(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(weights[name].numpy(), tensor.float().numpy())


def test_ernie_tokenizer_comes_from_the_file(tmp_path, monkeypatch):
    """transformers reads no config for ernie4_5, so its AutoTokenizer cannot choose a
    class: loom converts the file's vocabulary into a plain fast tokenizer (the real
    converter's SentencePiece vocabulary: benchmarks/ernie_gguf_converter.py)."""
    from loom.envs import settings
    from loom.tokenizer import load_tokenizer

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    settings.cache_clear()
    checkpoint = make_tiny_checkpoint("ernie4_5", tmp_path / "ernie4_5")
    path = write_gguf(checkpoint, str(tmp_path / "ernie4_5.gguf"), "ernie4_5")
    tokenizer = load_tokenizer(path)
    assert tokenizer.hf.vocab_size == load_hf_config(checkpoint).vocab_size
    assert tokenizer.hf.decode([7, 9]) == "<t7><t9>"
    assert tokenizer.eos_token_ids == [2]


def copy_metadata(reader, writer) -> None:
    """Every key of ``reader``'s file (a gguf.GGUFReader) into ``writer`` (a
    gguf.GGUFWriter, which writes the header and architecture itself)."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                             else None)


def write_quantized_experts_gguf(checkpoint: str, path: str) -> str:
    """``write_gguf``'s Qwen3-MoE file with its stacked experts quantized, mixing
    formats as llama.cpp's files do: gate and up Q4_1, down Q8_0."""
    import gguf

    plain = write_gguf(checkpoint, path + ".f32", "qwen3_moe")
    reader = gguf.GGUFReader(plain)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    copy_metadata(reader, writer)
    formats = {"ffn_gate_exps": gguf.GGMLQuantizationType.Q4_1,
               "ffn_up_exps": gguf.GGMLQuantizationType.Q4_1,
               "ffn_down_exps": gguf.GGMLQuantizationType.Q8_0}
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        kind = next((k for k in formats if f".{k}." in tensor.name), None)
        if kind is None:
            writer.add_tensor(tensor.name, data)
            continue
        qtype = formats[kind]
        writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_quantized_experts_stay_quantized(tmp_path, caplog):
    """A file whose stacked experts are Q4_1/Q8_0: loom keeps each expert in the file's
    format (uint8, no full-precision copy) and gives the tokens of the same file
    dequantized, float32; in bf16 the replayed forward runs the kept experts."""
    import logging

    # 64-wide expert rows: quantized blocks are 32 input features
    from loom.model.layers.fused_moe import FusedMoE
    from loom.model.loader import load_model

    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path / "q", moe_intermediate_size=64)
    path = write_quantized_experts_gguf(checkpoint, str(tmp_path / "q.gguf"))
    model = load_model(path, load_hf_config(path), dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.w13_weight is None and m.w2_weight is None for m in layers)
    for layer in layers:  # each expert in the file's formats, no full-precision copy
        assert [(e.w13.weight_format, e.w2.weight_format) for e in layer.experts] == \
            [("Q4_1", "Q8_0")] * 8
        assert all(p.dtype == torch.uint8 for e in layer.experts for p in e.parameters()
                   if p.dim() == 2), layer
    del model
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    caplog.set_level(logging.INFO)
    for name, kwargs in (("kept", {"quantization": "auto"}),
                         ("dequantized", {"quantization": "none"}),
                         ("kept-bf16", {"quantization": "auto", "dtype": "bfloat16"})):
        caplog.clear()
        llm = LLM(path, max_model_len=128, skip_tokenizer_init=True, enable_warm_up=False,
                  **({"dtype": "float32"} | kwargs))
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            runs[name] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
        said = [r.getMessage() for r in caplog.records]
        # only the file's F32 tensors (attention, embedding) are listed as dequantized
        dequantized = [m.rsplit(":", 1)[1] for m in said if "dequantized (loom keeps" in m]
        assert all("Q4_1" not in m and "Q8_0" not in m for m in dequantized), said
    assert runs["kept"] == runs["dequantized"]
    # (its attention weights are F32, so bf16 linears: a replay needs the bf16 kernel too)
    if native_ops() is not None and native_ops().quant_gemm_available() \
            and native_ops().bf16_gemm_available():
        assert "forward: replayed from loom's native kernels (recorded per shape)" in said
    # bf16 activations may flip a near-tie late in a sequence; the first tokens agree
    assert [r[:2] for r in runs["kept-bf16"]] == [r[:2] for r in runs["kept"]]
