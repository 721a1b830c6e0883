"""Ctrl-C, as a terminal sends it (SIGINT to the foreground process group), while
``loom generate`` or an ``LLM`` script is mid-generation: it stops promptly, says so,
and leaves no process and no shared-memory segment. With worker processes too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from checkpoints import make_tiny_checkpoint
from test_cli_errors import REPO_ROOT, assert_no_debris
from tokenizer_fixtures import make_tiny_tokenizer

# Generous: the point is "not 33 s", and the machine may be busy. The stop itself
# takes about a second (see the report in the test output).
STOP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    return make_tiny_tokenizer(path)


def interrupt_when(proc: subprocess.Popen, marker: str) -> tuple[str, str, float]:
    """Wait for ``marker`` on stderr, SIGINT the process group; (stdout, stderr, seconds
    from the signal to the exit). Every process of the session is checked for after."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            break
    else:
        raise AssertionError(f"{marker!r} never came: {''.join(seen)}")
    time.sleep(0.5)  # well inside the generation
    assert proc.poll() is None, "finished before the interrupt; give it more work"
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=STOP_TIMEOUT_S)
    elapsed = time.monotonic() - sent
    print(f"stopped {elapsed:.2f} s after SIGINT")
    assert_no_debris(proc.pid)
    return stdout, "".join(seen) + stderr, elapsed


def _as_from_a_terminal() -> None:
    """SIGINT at its default, as a terminal's foreground job has it: a shell starts
    background jobs (CI run with `&`, nohup) with SIGINT ignored, which every child
    inherits, and Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_as_from_a_terminal)


# 64 prompts x 480 tokens that ignore eos: tens of seconds of work for the tiny model.
_WORK = ["--max-tokens", "480", "--max-model-len", "512", "--ignore-eos",
         *[arg for i in range(64) for arg in ("--prompt", f"story number {i}")]]


@pytest.mark.parametrize("tp", ["1", "2"])
def test_ctrl_c_stops_loom_generate(tiny_model, tp):
    proc = start([sys.executable, "-m", "loom.cli", "generate", "--model", tiny_model,
                  "-tp", tp, "--kv-cache-memory", "64MiB", *_WORK])
    stdout, stderr, _ = interrupt_when(proc, "generating 64 completions")
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "loom generate: interrupted"
    assert "Traceback" not in stderr
    assert stdout == ""


def test_ctrl_c_stops_an_llm_script_with_worker_processes(tiny_model, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "from loom import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_model!r}, tensor_parallel_size=2, max_model_len=512,\n"
        "              kv_cache_memory_bytes=64 * 2**20)\n"
        "    print('generating', file=sys.stderr, flush=True)\n"
        "    llm.generate([f'story {i}' for i in range(64)],\n"
        "                 SamplingParams(max_tokens=480, ignore_eos=True), use_tqdm=False)\n"
        "    print('finished')\n")
    proc = start([sys.executable, str(script)])
    stdout, stderr, _ = interrupt_when(proc, "generating")
    # Python's own ending for an uncaught KeyboardInterrupt: killed by SIGINT.
    assert proc.returncode == -signal.SIGINT, stderr
    assert "KeyboardInterrupt" in stderr and "finished" not in stdout

