"""Bad input on the command line: one line naming the thing and the fix, exit status 2,
no traceback, no process and no /dev/shm segment left behind. Each case is a real
``loom`` subprocess; every check that can runs before a weight is read or a process
starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_loom(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``python -m loom.cli ARGS`` in its own session; asserts it left no process and no
    shared-memory segment (loom names them ``loom-<owner pid>-...``)."""
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stdout, stderr = proc.communicate(timeout=timeout)
    assert_no_debris(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def assert_no_debris(session_pid: int) -> None:
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker leaves last
    while (left := _session_processes(session_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {[p.cmdline() for p in left]}"
    segments = [name for name in os.listdir("/dev/shm") if name.startswith(f"loom-{session_pid}-")]
    assert not segments, f"/dev/shm debris: {segments}"


def _session_processes(session_pid: int) -> list[psutil.Process]:
    left = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_pid and process.status() != "zombie":
                left.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return left


def assert_one_line_error(run: subprocess.CompletedProcess, *fragments: str) -> str:
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, run.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    return make_tiny_tokenizer(path)


def generate(model: str, *args: str) -> subprocess.CompletedProcess:
    return run_loom("generate", "--model", model, "--prompt", "hello", "--max-tokens", "2", *args)


def test_model_directory_without_tokenizer_points_to_the_flag(tiny_model, tmp_path):
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model, name), bare / name)
    line = assert_one_line_error(generate(str(bare)), str(bare), "no tokenizer files",
                                 "--tokenizer")
    assert "tokenizer.json" in line
    # --tokenizer is the fix.
    ok = generate(str(bare), "--tokenizer", tiny_model, "--kv-cache-memory", "4MiB",
                  "--max-model-len", "128")
    assert ok.returncode == 0, ok.stderr


def test_unsupported_architecture_is_named_before_the_tokenizer(tmp_path):
    model = tmp_path / "gpt2ish"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_one_line_error(generate(str(model)), "GPT2LMHeadModel", "not supported",
                          "LlamaForCausalLM", "Qwen3ForCausalLM")


def _write_gguf(path: str) -> int:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.getsize(path)


def test_truncated_gguf_names_expected_and_actual_bytes(tmp_path):
    whole = str(tmp_path / "whole.gguf")
    size = _write_gguf(whole)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(whole, "rb").read()[:size // 2])
    assert_one_line_error(generate(str(cut)), str(cut), "truncated", f"need {size} bytes",
                          f"has {size // 2}")
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(open(whole, "rb").read()[:40])
    assert_one_line_error(generate(str(header_cut)), str(header_cut), "truncated or corrupt")


def test_empty_gguf(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_one_line_error(generate(str(empty)), str(empty), "is empty")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
def test_device_cuda_without_cuda(tiny_model):
    assert_one_line_error(generate(tiny_model, "--device", "cuda"), "--device cuda",
                          "--device cpu")


def test_tensor_parallel_size_is_checked_against_heads_before_any_process(tiny_model):
    # The tiny model has 4 attention heads and 2 KV heads.
    assert_one_line_error(generate(tiny_model, "-tp", "3"), "--tensor-parallel-size 3",
                          "4 attention heads", "[1, 2, 4]")


def test_tensor_parallel_size_is_checked_against_kv_heads():
    from checkpoints import make_tiny_config

    from loom.config_checks import check_tensor_parallel

    config = make_tiny_config("llama")
    config.num_attention_heads, config.num_key_value_heads = 12, 4
    with pytest.raises(ValueError, match=r"6 does not fit the model's 4 KV heads.*\[1, 2, 4, 12\]"):
        check_tensor_parallel(config, 6, 1, "cpu")
    check_tensor_parallel(config, 4, 1, "cpu")


def test_more_ranks_than_cpu_cores_is_a_warning(monkeypatch, caplog):
    from checkpoints import make_tiny_config

    from loom.config_checks import check_tensor_parallel

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("WARNING", logger="loom.config"):
        check_tensor_parallel(make_tiny_config("llama"), 2, 1, "cpu")
        assert not caplog.records
        check_tensor_parallel(make_tiny_config("llama"), 4, 1, "cpu")
    assert "4 tensor-parallel ranks on this host but only 2 CPU cores" in caplog.text


def test_kv_budget_too_small_for_one_sequence_fails_before_loading(tiny_model):
    line = assert_one_line_error(generate(tiny_model, "--kv-cache-memory", "1KiB"),
                                 "--kv-cache-memory", "cannot hold one sequence",
                                 "max_model_len=512")
    # The tiny model: 2 layers x K,V x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB.
    assert "8.0 KiB each" in line and "raise --kv-cache-memory" in line


def test_unknown_kv_cache_dtype_names_the_flag_and_the_supported_ones(tiny_model):
    assert_one_line_error(generate(tiny_model, "--kv-cache-dtype", "fp8_e4m3fnuz"),
                          "--kv-cache-dtype", "fp8_e4m3fnuz", "auto", "bfloat16", "int8",
                          "fp8_e4m3", "fp8_e5m2")


def test_model_given_twice_to_serve():
    assert_one_line_error(run_loom("serve", "/a", "--model", "/b"), "MODEL given twice")


def test_chunked_prefill_off_needs_a_budget_of_max_model_len(tiny_model):
    assert_one_line_error(generate(tiny_model, "--no-enable-chunked-prefill",
                                   "--max-num-batched-tokens", "100", "--max-model-len", "200"),
                          "max_num_batched_tokens (100)", "max_model_len (200)")


def test_script_without_main_guard_names_the_fix(tiny_model, tmp_path):
    """Worker processes re-import the script (spawn): the LLM it builds at import time
    stops there, and the parent's LLM says why."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from loom import LLM\n"
        f"llm = LLM({tiny_model!r}, tensor_parallel_size=2, max_model_len=128,\n"
        "          kv_cache_memory_bytes=2**22)\n"
        "print('built an LLM without the guard')\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert_no_debris(proc.pid)
    assert proc.returncode != 0 and "built an LLM" not in stdout
    assert stderr.strip().splitlines()[-1] == (
        "RuntimeError: a worker process re-imported the main script and it created an LLM "
        "again; create the LLM under `if __name__ == \"__main__\":` in your script (worker "
        "processes start with multiprocessing's spawn, which re-imports it)")


def test_data_parallel_flags_that_do_not_fit_together(tiny_model):
    """Replicas on several hosts: each mistake is one line, before anything starts."""
    assert_one_line_error(run_loom("serve", tiny_model, "--headless", "-dp", "2", "-dpr", "1"),
                          "--headless needs --data-parallel-address")
    import argparse

    from loom.entrypoints.openai.server import data_parallel_kwargs

    def check(**flags):
        args = dict(data_parallel_size=2, data_parallel_size_local=None,
                    data_parallel_start_rank=0, data_parallel_address="10.0.0.1",
                    data_parallel_rpc_port=29550, headless=False)
        return data_parallel_kwargs(argparse.Namespace(**{**args, **flags}))

    with pytest.raises(ValueError, match="--data-parallel-size-local 3 is more than "
                                         "--data-parallel-size 2"):
        check(data_parallel_size_local=3)
    with pytest.raises(ValueError, match=r"--data-parallel-start-rank 2 is out of range for "
                                         r"--headless: the head runs rank 0, so give 1\.\.1"):
        check(headless=True, data_parallel_start_rank=2)
    with pytest.raises(ValueError, match="--data-parallel-start-rank is for --headless hosts"):
        check(data_parallel_start_rank=1)
    with pytest.raises(ValueError, match="runs ranks past the last, 2"):
        check(headless=True, data_parallel_size=3, data_parallel_start_rank=2,
              data_parallel_size_local=2)
    with pytest.raises(ValueError, match="--data-parallel-size >= 2"):
        check(headless=True, data_parallel_size=1, data_parallel_start_rank=1)
    assert check(headless=True, data_parallel_start_rank=1)["data_parallel_size_local"] == 1
    assert check(data_parallel_size_local=1)["data_parallel_address"] == "10.0.0.1"


def test_kv_offload_path_that_cannot_take_a_file(tiny_model, tmp_path):
    """--kv-offload-path: a directory loom may not write to, one line before any weight
    loads (root writes anywhere but sysfs); a file, or a size below one block, likewise."""
    if os.geteuid() == 0:
        directory = "/sys"
    else:
        directory = str(tmp_path / "read-only")
        os.mkdir(directory, 0o555)
    assert_one_line_error(generate(tiny_model, "--kv-offload-size", "1MiB",
                                   "--kv-offload-path", directory),
                          f"--kv-offload-path {directory} is not writable", "a directory loom "
                          "may write to")
    from loom.engine_args import make_engine_config

    with pytest.raises(ValueError, match="--kv-offload-path .* is not a directory"):
        make_engine_config(tiny_model, kv_offload_size=2**20,
                           kv_offload_path=os.path.join(tiny_model, "config.json"))
    # the tiny model's block of 16 tokens: 8 KiB
    with pytest.raises(ValueError, match=r"--kv-offload-size 4.0 KiB holds no KV block \(8.0 KiB"):
        make_engine_config(tiny_model, kv_offload_size=4096, kv_offload_path=str(tmp_path))
    with pytest.raises(ValueError, match="--kv-offload-path needs --kv-offload-size"):
        make_engine_config(tiny_model, kv_offload_path=str(tmp_path))


@pytest.mark.parametrize("value", ['{"video": {"num_frames": 0}}', '{"video": {"fps": 2}}',
                                   '{"audio": {}}'])
def test_bad_media_io_kwargs_is_one_line_at_start_up(tiny_model, value):
    assert_one_line_error(run_loom("serve", tiny_model, "--media-io-kwargs", value),
                          'media_io_kwargs takes {"video": {"num_frames": N}}')
