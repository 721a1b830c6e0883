"""loom's GGUF reader and torch dequantization equal gguf-py's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from loom.model.loader.gguf_dequant import dequantize
from loom.model.loader.gguf_file import GGUFFile

# byte offsets of the float16 fields (d, m, dmin) inside one block of each type
_F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
               T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every field, but finite float16 scales (random bytes would
    include NaN and inf, whose bit patterns numpy and torch need not agree on)."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.standard_normal((rows, blocks_per_row)).astype(np.float16) * 0.05
        data[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return data.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("qtype", list(_F16_FIELDS), ids=lambda t: t.name)
def test_quantized_types_are_bit_exact(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 7, 3
    data = random_blocks(qtype, rows, blocks_per_row, seed=int(qtype))
    expected = gguf_dequantize(data, qtype)  # (rows, blocks_per_row * block_size) float32
    ours = dequantize(data, int(qtype), (rows, blocks_per_row * block_size))
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_are_bit_exact(qtype):
    values = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    if qtype == T.BF16:
        data = gguf.quants.quantize(values, qtype)
    else:
        data = values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8)
    expected = gguf_dequantize(data, qtype).reshape(5, 64)
    ours = dequantize(data, int(qtype), (5, 64))
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))


def test_unlisted_type_falls_back_to_gguf_quants():
    qtype = T.Q2_K
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(2).integers(0, 256, (3, type_size), dtype=np.uint8)
    data[:, -4:] = np.full((3, 2), 0.01, np.float16).view(np.uint8)  # d, dmin at the end
    expected = gguf_dequantize(data, qtype)
    ours = dequantize(data, int(qtype), (3, block_size))
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_reader_matches_gguf_writer(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_token_list(["<s>", "a", "bé"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    writer.add_string("general.name", "tiny")
    weight = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    quantized = gguf.quants.quantize(weight, T.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", weight[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 2
    assert f.metadata["llama.rope.freq_base"] == 10000.0
    assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "bé"]
    np.testing.assert_array_equal(f.metadata["tokenizer.ggml.scores"], [0.5, 1.5, 2.5])
    q = f.tensors["blk.0.attn_q.weight"]
    assert (q.ggml_type, q.shape) == (int(T.Q8_0), (4, 64))
    np.testing.assert_array_equal(f.tensor_bytes(q), quantized)
    norm = f.tensors["output_norm.weight"]
    assert norm.shape == (64,)
    assert torch.equal(dequantize(f.tensor_bytes(norm), norm.ggml_type, norm.shape),
                       torch.from_numpy(weight[0]))
