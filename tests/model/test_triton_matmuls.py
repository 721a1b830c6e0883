"""loom's Triton matmuls (LOOM_TRITON_MATMULS=1: loom/model/layers/triton_linear.py, the
quantized linears read packed; triton_moe.py, the fused MoE): their kernels give the
PyTorch reference's results under Triton's interpreter on the CPU, they compile to cubin
for an H100 and an A100, and the switch is off by default.

The kernels' cases are tests/model/triton_matmul_cases.py, run here in a fresh process
with TRITON_INTERPRET=1 (Triton reads that switch when it decorates a function, its own
library's at its import included, and this process may have imported triton already,
compiled for a GPU; see tests/model/test_triton_attention.py) and LOOM_NATIVE_KERNELS=0
(the cases compare with the PyTorch paths, which a float32 model on the CPU takes anyway).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from loom.envs import Settings, settings
from loom.model.layers.weight_forms import QuantizedReference, RowBlocks, select_form

from .test_triton_attention import _environ  # the interpreter's process, set up alike

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = "tests/model/triton_matmul_cases.py"
NUM_CASES = 39  # the cases file's tests, parametrizations counted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the triton package is not installed")


@needs_triton
def test_kernels_equal_the_pytorch_reference_under_the_interpreter():
    """Every case passes, none skipped."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--durations=5", CASES], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=_environ(TRITON_INTERPRET="1",
                                                   LOOM_NATIVE_KERNELS="0",
                                                   LOOM_TRITON_MATMULS=None))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{NUM_CASES} passed\b", summary), summary
    assert "skipped" not in summary and "deselected" not in summary, summary


def test_the_switch_is_off_by_default_and_off_the_gpu(monkeypatch):
    """Unset, quantized weights stay on the PyTorch reference wherever they are (on CUDA
    too: nothing here has run on a GPU yet); set, it applies to CUDA only (and to the
    CPU under Triton's interpreter, which is for tests)."""
    from loom.model.layers.quantization import quantize_wint8

    assert Settings.from_environ({}).triton_matmuls is False
    assert Settings.from_environ({"LOOM_TRITON_MATMULS": "1"}).triton_matmuls is True
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weight = quantize_wint8(torch.randn(8, 64))
    for switch in ("0", "1"):
        monkeypatch.setenv("LOOM_TRITON_MATMULS", switch)
        settings.cache_clear()
        try:
            form = select_form(RowBlocks([weight]), torch.device("cpu"), torch.float32)
        finally:
            settings.cache_clear()
        assert type(form) is QuantizedReference


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                  torch.int8: "*i8"}


def _compile(fn, target, constants: dict, types: dict[str, str]):
    import triton
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constants), target=target)


# (format, activation dtype): every width (8, 4, 5, 6 bits) and scale kind (float32 per
# row, float16 per group with and without offsets, two-level int8 x float16, with and
# without), each activation dtype
COMPILED = [("wint8", torch.bfloat16), ("Q4_1", torch.float32), ("Q5_0", torch.float16),
            ("Q4_K", torch.bfloat16), ("Q6_K", torch.bfloat16)]


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 the kernels are interpreted, not compiled")
@pytest.mark.parametrize("case", COMPILED, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def test_quantized_kernels_compile_to_cubin_for_an_h100_and_an_a100(case):
    """Triton's own compiler and ptxas (shipped in its wheel) build the GEMV and GEMM
    kernels for sm_90 and sm_80 with no GPU here, as ``quantized_matmul`` launches them
    (``gemv_constants``, ``gemm_constants``). Running them is a GPU's job."""
    from triton.backends.compiler import GPUTarget

    from loom.model.layers import triton_linear

    from .quantized_formats import make_weight

    fmt, dtype = case
    weight = make_weight(fmt, 64, 256, seed=0).held()
    scale_type = _POINTER_TYPES[weight.scales.dtype]
    types = dict(out_ptr=_POINTER_TYPES[dtype], x_ptr=_POINTER_TYPES[dtype],
                 values_ptr="*u8", scales_ptr=scale_type, offsets_ptr=scale_type,
                 super_scales_ptr="*fp16", super_offsets_ptr="*fp16", bias_ptr="*fp32")
    for capability in (90, 80):
        target = GPUTarget("cuda", capability, 32)
        for rows in (1, 8):
            kernel = _compile(triton_linear._quant_gemv_kernel, target,
                              triton_linear.gemv_constants(weight, rows, rows == 8), types)
            assert kernel.asm["cubin"]
        constants = triton_linear.gemm_constants(weight, dtype, True, interpreted=False)
        kernel = _compile(triton_linear._quant_gemm_kernel, target, constants, types)
        assert kernel.asm["cubin"]


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 the kernels are interpreted, not compiled")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_kernel_compiles_to_cubin_for_an_h100_and_an_a100(dtype):
    """Both launches (w13 without the routing weights, w2 with them)."""
    from triton.backends.compiler import GPUTarget

    from loom.model.layers import triton_moe

    element = _POINTER_TYPES[dtype]
    types = dict(out_ptr=element, a_ptr=element, b_ptr=element, topk_weights_ptr="*fp32",
                 sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32")
    for capability in (90, 80):
        target = GPUTarget("cuda", capability, 32)
        for weigh, rows_per_a in ((False, 2), (True, 1)):
            constants = triton_moe.kernel_constants(dtype, weigh, rows_per_a, interpreted=False)
            kernel = _compile(triton_moe._fused_moe_kernel, target, constants, types)
            assert kernel.asm["cubin"]
