"""The cases of tests/model/test_triton_matmuls.py that run loom's Triton matmul kernels
(loom/model/layers/triton_linear.py: quantized linears read packed; triton_moe.py: the
fused MoE) on the CPU, under Triton's interpreter. That test runs this file in a fresh
process with TRITON_INTERPRET=1 and LOOM_NATIVE_KERNELS=0: Triton reads the switch when
it decorates, its own library's functions at its import included, so it must be set
before anything imports triton, and must not reach the other tests' process.
On a GPU (``LOOM_TEST_DEVICE=cuda``, ``benchmarks/cuda_check.sh``) the same cases run the
compiled kernels on CUDA tensors.

Quantized matmuls: every format loom keeps (wint8, wint4, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q5_K, Q6_K), held as the PyTorch path holds it on CUDA (``QuantizedTensor.held()``),
against dequantize-then-matmul (``reference_linear``), for 1, 3 (the GEMV kernel) and 17
rows (the tiled GEMM), float32 and bf16 activations. The tolerance is the float32
rounding both sides may do, no more (``sum_error_bound``): the kernels multiply x by the
exact integers q - z and scale each group's float32 sum, so the terms are the
reference's and only the order of float32 sums differs; with a bf16 output, one more
rounding. Then the switch (LOOM_TRITON_MATMULS) through the layers: a linear layer and
a fused layer of two formats take the Triton form, and greedy tokens through the engine
equal the PyTorch path's.

Fused MoE: the layer's results with its experts through the grouped kernel against the
layer's PyTorch path (the loop over experts), for several (tokens, experts, top-k),
expert parallel, and greedy tokens of a tiny Qwen3-MoE.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/model/test_triton_matmuls.py, under TRITON_INTERPRET=1",
                allow_module_level=True)

from loom.envs import settings  # noqa: E402
from loom.model.layers import triton_linear, triton_moe  # noqa: E402
from loom.model.layers.fused_moe import FusedMoE, MoESpec  # noqa: E402
from loom.model.layers.quantization import QuantizedTensor, reference_linear  # noqa: E402
from loom.model.layers.weight_forms import (MixedFormats, QuantizedReference,  # noqa: E402
                                            RowBlocks, TritonQuantized, select_form)

from .quantized_formats import FORMATS, make_weight  # noqa: E402

U32 = 2.0 ** -24  # float32 unit roundoff
# a float32 result stored as bf16 moves by at most half a bf16 unit (2^-8 relative) on a
# GPU, which rounds to nearest even; Triton's interpreter truncates (its cast_impl), a
# whole unit
BF16_STORE = 2.0 ** -8 if DEVICE == "cuda" else 2.0 ** -7


def test_the_kernels_are_interpreted_on_the_cpu_only():
    assert triton_linear.INTERPRETED == (DEVICE == "cpu")


@pytest.fixture
def triton_matmuls(monkeypatch):
    """LOOM_TRITON_MATMULS=1 for one test (settings re-read before and after)."""
    monkeypatch.setenv("LOOM_TRITON_MATMULS", "1")
    settings.cache_clear()
    yield
    monkeypatch.undo()
    settings.cache_clear()


def sum_error_bound(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """A bound on |kernel - reference| for each float32 output of ``x @ W^T``: each side
    sums at most K + 4 float32 terms (the kernel: a tile's products, its scaling, m
    times the tile's sum of x, the tiles; the reference: its matmul), so each is within
    (K + 4) 2^-24 of the sum of the magnitudes it adds, which |x| (|d| |q - z| + |m|)
    bounds term by term (|W| itself for a symmetric format)."""
    expanded = weight.expanded()
    n, k = weight.shape
    d, m = expanded.scales_and_offsets()
    groups = d.shape[1]
    q = expanded.values.float().view(n, groups, k // groups)
    if m is None:
        magnitude = (q - expanded.zero_point).abs() * d.abs().unsqueeze(2)
    else:
        magnitude = q * d.abs().unsqueeze(2) + m.abs().unsqueeze(2)
    return 2 * (k + 4) * U32 * (x.float().abs() @ magnitude.view(n, k).t()) + 1e-30


def assert_within(got: torch.Tensor, x: torch.Tensor, weight: QuantizedTensor,
                  bias: torch.Tensor | None = None) -> None:
    """``got`` (x's rows times ``weight``, in float32 or bf16) within float32 rounding
    of the reference's float32 result, plus the bf16 store's rounding where ``got`` is
    bf16 (``BF16_STORE``)."""
    reference = reference_linear(x.float(), weight, None if bias is None else bias.float(),
                                 torch.float32)
    bound = sum_error_bound(x, weight)
    if bias is not None:
        bound = bound + bias.float().abs() * 2 * U32
    if got.dtype == torch.bfloat16:  # one more rounding, to bf16
        bound = bound * (1 + BF16_STORE) + reference.abs() * BF16_STORE
    error = (got.float() - reference).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


# ---------------------------------------------------------------- the quantized kernels

SHAPES = [(48, 256), (33, 512)]  # (N, K): N not a multiple of the kernels' 32 or 64 rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantized_matmul_equals_dequantize_then_matmul(fmt, shape):
    n, k = shape
    weight = make_weight(fmt, n, k, seed=n + k)
    held = weight.held()
    assert held.packed and held.values.shape[1] == k * weight.bits // 8
    held = held.to(torch.device(DEVICE))
    gen = torch.Generator().manual_seed(k)
    for rows in (1, 3, 17):  # the GEMV kernel (up to 8 rows), the tiled GEMM
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            got = triton_linear.quantized_matmul(x.to(DEVICE), held)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert_within(got.cpu(), x, weight)


@pytest.mark.parametrize("rows", [2, 17])
def test_bias_float_output_strided_rows_and_columns_of_a_wider_output(rows):
    """A bias, float32 sums kept from bf16 rows (an LM head's logits), x a view with a
    wider stride (columns of a fused output), written into columns of another output,
    and a wint8 row of 200 features (no whole tile: masked), float16 rows too."""
    gen = torch.Generator().manual_seed(rows)
    weight = make_weight("Q4_K", 40, 512, seed=3)
    held = weight.held().to(torch.device(DEVICE))
    bias = torch.randn(40, generator=gen)
    wide = torch.randn(rows, 512 + 64, generator=gen).bfloat16()
    x = wide[:, 64:]
    got = triton_linear.quantized_matmul(x.to(DEVICE), held, bias.to(DEVICE), torch.float32)
    assert got.dtype == torch.float32
    assert_within(got.cpu(), x, weight, bias)
    out = torch.full((rows, 100), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    triton_linear.quantized_matmul(x.to(DEVICE), held, out=out[:, 30:70])
    assert_within(out[:, 30:70].cpu(), x, weight)
    assert out[:, :30].isnan().all() and out[:, 70:].isnan().all()
    weight = make_weight("wint8", 24, 200, seed=4)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(rows, 200, generator=gen).to(dtype)
        got = triton_linear.quantized_matmul(x.to(DEVICE), weight.held().to(
            torch.device(DEVICE)), out_dtype=torch.float32)
        assert_within(got.cpu(), x, weight)


def test_each_value_of_each_width_is_read_where_pack_bits_put_it():
    """One weight row whose every value is distinct in a way a misplaced bit would
    change, multiplied by one-hot rows: the kernel's output is the dequantized row."""
    for bits in (4, 5, 6, 8):
        k = 64
        values = (torch.arange(k) * 7 % (1 << bits)).to(torch.uint8).view(1, k)
        scales = torch.ones(1, k // 32, dtype=torch.float16)
        weight = QuantizedTensor(values, scales, None, bits, f"{bits}-bit")
        for rows in (1, 17):  # each kernel
            x = torch.eye(k)[:rows]
            got = triton_linear.quantized_matmul(x.to(DEVICE), weight.held().to(
                torch.device(DEVICE)))
            expected = weight.dequantize()[0, :rows]
            torch.testing.assert_close(got[:, 0].cpu(), expected, atol=0, rtol=0)


def test_the_switch_holds_layers_in_the_triton_form(triton_matmuls, monkeypatch):
    """LOOM_TRITON_MATMULS=1 (here on the CPU under the interpreter; on CUDA for real):
    a quantized weight is held as ``TritonQuantized``, a fused layer of two formats as
    ``MixedFormats`` of them, each writing its columns; the same results as the
    reference forms the switch off gives (for a float32 model the reference forms are
    what the CPU holds, as on CUDA)."""
    device = torch.device(DEVICE)
    q4k, q6k = make_weight("Q4_K", 24, 256, seed=5), make_weight("Q6_K", 16, 256, seed=6)
    one = select_form(RowBlocks([q4k.to(device)]), device, torch.float32)
    mixed = select_form(RowBlocks([q4k.to(device), q6k.to(device)]), device, torch.float32)
    assert type(one) is TritonQuantized and not one.dequantizes_per_matmul
    assert isinstance(mixed, MixedFormats) and mixed.format == "Q4_K+Q6_K"
    assert all(type(part) is TritonQuantized for part in mixed.parts)
    assert not mixed.dequantizes_per_matmul
    monkeypatch.setenv("LOOM_TRITON_MATMULS", "0")
    settings.cache_clear()
    reference = select_form(RowBlocks([q4k.to(device), q6k.to(device)]), device,
                            torch.float32)
    assert all(type(part) is QuantizedReference for part in reference.parts)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(40, generator=gen)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 256, generator=gen)
        for float_output in (False, True):
            got = mixed.apply(x.to(DEVICE), bias.to(DEVICE), float_output).cpu()
            assert got.shape == (rows, 40)
            assert_within(got[:, :24], x, q4k, bias[:24])
            assert_within(got[:, 24:], x, q6k, bias[24:])
            expected = reference.apply(x.to(DEVICE), bias.to(DEVICE), float_output).cpu()
            assert_within(expected[:, 24:], x, q6k, bias[24:])  # the bound holds both
        assert_within(one.apply(x.to(DEVICE), None).cpu(), x, q4k)


# ---------------------------------------------------------------- the fused MoE

def make_moe(num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
             seed: int = 0, **kwargs) -> FusedMoE:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        layer = FusedMoE(MoESpec(num_experts, top_k, inter), hidden_size=hidden, **kwargs)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.normal_(0, 0.2)
    return layer.to(dtype)


# (tokens, experts, top-k): a decode, more experts than tokens, every expert hit and
# some hit by more than a block of rows (16), top-k 1
MOE_SHAPES = [(1, 8, 2), (5, 8, 3), (40, 4, 2), (9, 6, 1)]
MOE_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                 torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "t%d-e%d-k%d" % s)
def test_fused_moe_equals_the_layer_s_pytorch_path(shape, dtype, triton_matmuls):
    """The layer's forward through the kernel against its PyTorch paths (the grouped
    experts and the loop over experts) on the same routing. float32: sums of a few
    dozen terms in another order (1e-5); bf16: the kernel rounds where the PyTorch path
    does (each matmul's output, the weighted output), so only float32 sum order moves a
    value across a bf16 rounding boundary, a unit (2^-8 relative) in the intermediate
    that the second matmul carries: a few units of the output (3e-2)."""
    num_tokens, num_experts, top_k = shape
    layer = make_moe(num_experts, top_k, 48, 40, dtype, seed=num_tokens)
    layer.process_weights_after_loading()
    assert layer.triton_experts
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(1)).to(
        dtype).to(DEVICE)
    with torch.inference_mode():
        fused = layer(x)
        layer.triton_experts = False
        grouped = layer(x)
        layer.use_grouped = False
        looped = layer(x)
    assert fused.dtype == dtype and fused.shape == x.shape
    torch.testing.assert_close(fused.float(), looped.float(), **MOE_TOLERANCE[dtype])
    torch.testing.assert_close(fused.float(), grouped.float(), **MOE_TOLERANCE[dtype])
    assert layer.tokens_per_expert.sum() == 3 * num_tokens * top_k  # counted each time


def test_expert_parallel_ranks_add_up_to_every_expert():
    """A rank holding experts 2..5 of 8 places only their assignments (the others get no
    row and add nothing); the ranks' parts sum to one rank's result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 32, generator=gen).to(DEVICE)
    w13 = (torch.randn(8, 48, 32, generator=gen) * 0.2).to(DEVICE)
    w2 = (torch.randn(8, 32, 24, generator=gen) * 0.2).to(DEVICE)
    weights, ids = torch.topk(torch.randn(11, 8, generator=gen).softmax(-1), 3)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    whole = triton_moe.fused_moe(x, w13, w2, weights, ids)
    parts = [triton_moe.fused_moe(x, w13[s:s + e], w2[s:s + e], weights, ids, expert_start=s)
             for s, e in ((0, 2), (2, 4), (6, 2))]
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)
    sorted_ids, block_expert, num_padded = triton_moe.align_to_blocks(ids, 4, 2)
    placed = sorted_ids[sorted_ids < ids.numel()].long().cpu()
    local = ids.flatten().cpu() - 2
    assert sorted(placed.tolist()) == [a for a in range(ids.numel()) if 0 <= local[a] < 4]
    # each placed row sits in a block of its own expert
    positions = (sorted_ids < ids.numel()).nonzero().flatten().cpu()
    assert (block_expert.cpu()[positions // triton_moe.BLOCK_M] == local[placed]).all()
    assert int(num_padded) % triton_moe.BLOCK_M == 0


def test_a_graph_step_runs_the_kernel_and_counts_only_its_real_rows(triton_matmuls):
    """In a CUDA graph's step (``graph_safe_experts``: rows past the step's real batch
    copy row 0) the experts still run the fused kernel, whose shapes the routing does
    not change, and the counts leave the padding rows out."""
    from loom.model.layers.fused_moe import graph_safe_experts

    layer = make_moe(8, 2, 48, 40, torch.float32, seed=3)
    layer.process_weights_after_loading()
    assert layer.triton_experts
    layer.step_tokens = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    padded = torch.cat([x, x[:1]])  # 3 requests padded to a bucket of 4
    with torch.inference_mode():
        eager = layer(x)
        counts = layer.step_tokens.clone()
        layer.step_tokens.zero_()
        with graph_safe_experts([layer], torch.tensor([1, 1, 1, 0], device=DEVICE)):
            replayed = layer(padded)
    assert layer.graph_rows is None
    torch.testing.assert_close(replayed[:3], eager, atol=1e-5, rtol=1e-5)
    assert layer.step_tokens.tolist() == counts.tolist() and int(counts.sum()) == 3 * 2


def test_alignment_pads_each_expert_to_whole_blocks():
    sorted_ids, block_expert, num_padded = triton_moe.align_to_blocks(
        torch.tensor([[2, 0], [2, 1]], device=DEVICE), 3, block_m=4)
    pad = 4
    assert sorted_ids.cpu().tolist() == [1, pad, pad, pad, 3, pad, pad, pad, 0, 2, pad, pad,
                                         pad, pad, pad, pad]
    assert block_expert.cpu().tolist()[:3] == [0, 1, 2] and int(num_padded) == 12


# ---------------------------------------------------------------- through the engine

PROMPTS = [list(range(3, 30)), [7, 8, 9]]  # a prefill of 27 rows (the GEMM), decodes


@pytest.mark.parametrize("family,quantization", [("llama", "wint4"), ("qwen3_moe", "none"),
                                                 ("qwen3_moe", "wint8")])
def test_greedy_tokens_equal_the_pytorch_path(family, quantization, tmp_path, monkeypatch):
    """float32 greedy tokens with LOOM_TRITON_MATMULS=1 equal the switch off: wint4
    linears (and the wint8 LM head) through the quantized kernels; Qwen3-MoE's
    full-precision experts through the fused MoE kernel, its wint8 ones each through
    the quantized kernels."""
    from loom import LLM, SamplingParams
    from tokenizer_fixtures import make_tiny_tokenizer

    from checkpoints import make_tiny_checkpoint

    path = make_tiny_tokenizer(make_tiny_checkpoint(family, tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("LOOM_TRITON_MATMULS", switch)
        settings.cache_clear()
        with LLM(path, device=DEVICE, dtype="float32", quantization=quantization,
                 max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
                 num_gpu_blocks_override=32, enable_warm_up=False) as llm:
            model = llm.engine.engine_core.executor.worker.model_runner.model
            forms = {type(m.form).__name__ for m in model.modules() if hasattr(m, "form")
                     and m.form.format is not None}
            moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                   use_tqdm=False)
        results[switch] = [list(o.outputs[0].token_ids) for o in outputs]
        if quantization != "none":
            assert forms == {"TritonQuantized" if switch == "1" else "QuantizedReference"}
        if moe and quantization == "none":
            assert all(m.triton_experts == (switch == "1") for m in moe)
    settings.cache_clear()
    assert all(len(tokens) == 4 for tokens in results["0"])
    assert results["1"] == results["0"]
