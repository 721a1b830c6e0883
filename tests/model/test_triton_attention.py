"""--attention-backend triton (loom/model/attention/triton_attention.py): its kernels give
the torch reference's results under Triton's interpreter on the CPU, it is opt-in (auto
never picks it, on CUDA neither), and on a CPU without the interpreter it is one line at
start-up, exit 2 from the CLI.

The kernels' cases are tests/model/triton_attention_cases.py, run here in a fresh process
with TRITON_INTERPRET=1: Triton reads that switch when it decorates a function, its own
library's at its import included, and this process may have imported triton already
(torch does, for transformers' generate), compiled for a GPU. The switch stays in that
process: xgrammar's Triton kernel and torch's stay as they are here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from loom import LLM
from loom.model.attention import select_attn_backend
from tokenizer_fixtures import make_tiny_tokenizer

from .checkpoints import make_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = "tests/model/triton_attention_cases.py"
NUM_CASES = 27  # the cases file's tests, parametrizations counted


def _environ(**changes: str | None) -> dict[str, str]:
    environ = dict(os.environ)
    for name, value in changes.items():
        environ.pop(name, None)
        if value is not None:
            environ[name] = value
    return environ


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="the triton package is not installed")


@needs_triton
def test_kernels_equal_the_torch_reference_under_the_interpreter():
    """Every case passes, none skipped. LOOM_NATIVE_KERNELS=0: the cases compare the
    triton and torch backends, so no CPU kernel needs building there."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--durations=0", CASES], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=_environ(TRITON_INTERPRET="1",
                                                   LOOM_NATIVE_KERNELS="0"))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{NUM_CASES} passed\b", summary), summary
    assert "skipped" not in summary and "deselected" not in summary, summary


def test_auto_keeps_torch_on_cuda_until_a_gpu_run_proves_triton():
    assert select_attn_backend("auto", "cuda", torch.bfloat16) == "torch"
    assert select_attn_backend("auto", "cuda", torch.float32) == "torch"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama")))


@needs_triton
def test_triton_on_the_cpu_is_one_line_at_start_up(model_dir, monkeypatch):
    message = ("--attention-backend triton needs CUDA (its Triton kernels run on the GPU), "
               "but the model runs on cpu; use --attention-backend auto, cpu or torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model_dir, attention_backend="triton", device="cpu", enable_warm_up=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        select_attn_backend("triton", "cpu", torch.float32)
    run = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--model", model_dir,
                          "--prompt", "hi", "--attention-backend", "triton", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=_environ(TRITON_INTERPRET=None))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert [line for line in run.stderr.splitlines() if "error" in line] == [
        f"loom generate: error: {message}"], run.stderr


# (dtype, cache dtype, decode step, splits, sliding window, GQA group, head_dim): prefill
# with a window over fp8 rows, float32 (IEEE dots), and a decode split over the context
# at head size 80 (padded to 128) with 8 query heads per KV head
COMPILED = [(torch.bfloat16, torch.float8_e4m3fn, False, 1, True, 2, 128),
            (torch.float32, torch.float32, False, 1, False, 1, 64),
            (torch.bfloat16, torch.bfloat16, True, 4, True, 8, 80)]
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def _compile(fn, target, constants: dict, types: dict[str, str]):
    import triton
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constants), target=target)


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under TRITON_INTERPRET=1 the kernels are interpreted, not compiled")
@pytest.mark.parametrize("case", COMPILED)
def test_kernels_compile_to_cubin_for_an_h100_and_an_a100(case):
    """Triton's own compiler and ptxas (shipped in its wheel) build the kernels for sm_90
    and sm_80 with no GPU here: types, shapes and matmul sizes pass the GPU compiler, as
    paged_attention launches them (kernel_constants). Running them is a GPU's job."""
    from triton.backends.compiler import GPUTarget

    from loom.model.attention import triton_attention

    dtype, cache_dtype, decode, splits, windowed, group, head_dim = case
    element = _POINTER_TYPES[dtype]
    types = dict(out_ptr=element, query_ptr=element, split_acc_ptr="*fp32",
                 split_max_ptr="*fp32", split_sum_ptr="*fp32", block_table_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale="fp32",
                 head_stride="i64", value_offset="i64",
                 cache_ptr=_POINTER_TYPES.get(cache_dtype, "*u8"))
    for capability in (90, 80):
        target = GPUTarget("cuda", capability, 32)
        constants = triton_attention.kernel_constants(
            8 * group, 8, head_dim, 16, dtype, cache_dtype, decode, splits, windowed,
            interpreted=False)
        kernel = _compile(triton_attention._paged_attention_kernel, target, constants, types)
        assert kernel.asm["cubin"]
        if splits > 1:
            kernel = _compile(triton_attention._reduce_splits_kernel, target,
                              triton_attention.reduce_constants(8 * group, head_dim, splits),
                              types)
            assert kernel.asm["cubin"]
