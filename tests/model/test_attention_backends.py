"""--attention-backend (``LLM(attention_backend=...)``) chooses among the registered
backends: the chosen one is what every layer runs, both give the same greedy tokens,
auto means cpu where loom's native kernels apply (else torch) and is logged once, and an
unknown name is one line naming the registered ones (exit 2 on the CLI)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from loom import LLM, SamplingParams
from tokenizer_fixtures import make_tiny_tokenizer

from .checkpoints import make_tiny_checkpoint

# Chunked prefill (budget 16 tokens a step), mixed prefill + decode steps, batched decodes.
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 130)), [5] * 12]
MAX_TOKENS = 10
ENGINE_KWARGS = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
                     num_gpu_blocks_override=64, enable_warm_up=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama")))


def greedy(path: str, **kwargs) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of PROMPTS, and the backend names the model's layers run."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, **ENGINE_KWARGS, **kwargs) as llm:
        model = llm.engine.engine_core.executor.worker.model_runner.model
        names = {layer.impl.name for layer in model.attention_layers}
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], names


def test_float32_greedy_tokens_are_equal_under_torch_and_cpu(model_dir):
    torch_tokens, torch_names = greedy(model_dir, dtype="float32", attention_backend="torch")
    cpu_tokens, cpu_names = greedy(model_dir, dtype="float32", attention_backend="cpu")
    assert torch_names == {"torch"} and cpu_names == {"cpu"}
    assert all(len(tokens) == MAX_TOKENS for tokens in torch_tokens)
    assert cpu_tokens == torch_tokens


def test_bfloat16_greedy_tokens_agree_within_tolerance(model_dir):
    """bf16 rounds differently along the two paths (the cpu backend's forward is also
    replayed from the kernels); the tolerance of tests/model/test_models.py's bf16 check: at
    least 90% of positions give the same token (a divergence counts for every later
    position of that sequence)."""
    torch_tokens, torch_names = greedy(model_dir, dtype="bfloat16", attention_backend="torch")
    cpu_tokens, cpu_names = greedy(model_dir, dtype="bfloat16", attention_backend="cpu")
    assert torch_names == {"torch"} and cpu_names == {"cpu"}
    same = sum(a == b for x, y in zip(torch_tokens, cpu_tokens) for a, b in zip(x, y))
    assert same >= 0.9 * len(PROMPTS) * MAX_TOKENS, (torch_tokens, cpu_tokens)


def test_auto_is_cpu_with_the_kernels_else_torch_and_is_logged_once(model_dir, caplog,
                                                                   monkeypatch):
    import loom.kernels

    assert loom.kernels.native_ops() is not None
    with caplog.at_level(logging.INFO, logger="loom.worker.model_runner"):
        auto_tokens, names = greedy(model_dir, dtype="float32")
    assert names == {"cpu"}
    assert [r.getMessage() for r in caplog.records
            if "attention backend" in r.getMessage()] == ["attention backend: cpu (auto)"]
    caplog.clear()
    monkeypatch.setattr(loom.kernels, "_module", None)  # as LOOM_NATIVE_KERNELS=0
    with caplog.at_level(logging.INFO, logger="loom.worker.model_runner"):
        fallback_tokens, names = greedy(model_dir, dtype="float32")
    assert names == {"torch"}
    assert [r.getMessage() for r in caplog.records
            if "attention backend" in r.getMessage()] == ["attention backend: torch (auto)"]
    assert fallback_tokens == auto_tokens


def test_unknown_backend_is_one_line_naming_the_registered_ones(model_dir):
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; choose one of "
                                         r"auto, cpu, torch, triton \(--attention-backend\)"):
        LLM(model_dir, attention_backend="flash", **ENGINE_KWARGS)
    run = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--model", model_dir,
                          "--prompt", "hi", "--attention-backend", "flash"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert errors == ["loom generate: error: unknown attention backend 'flash'; choose one of "
                      "auto, cpu, torch, triton (--attention-backend)"], run.stderr
