"""A real ``loom serve`` subprocess for tests, on a tiny model, on a free port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_READY = re.compile(r"ready on (https?://\S+)")
# Small enough to start fast, big enough for every test: 64 MiB of KV cache is
# thousands of blocks for the tiny model.
TINY_SERVER_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")


def make_tiny_model_dir(path: str) -> str:
    """A tiny random Llama (vocab 256) with the tiny ChatML tokenizer beside it."""
    tests_dir = os.path.join(REPO_ROOT, "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from model.checkpoints import make_tiny_checkpoint
    from tokenizer_fixtures import make_tiny_tokenizer

    make_tiny_checkpoint("llama", path)
    make_tiny_tokenizer(path)
    return path


def start_headless(model: str, port: int, rank: int, size: int, *args: str) -> subprocess.Popen:
    """``loom serve MODEL ARGS --headless`` for data-parallel replica ``rank`` of ``size``,
    its head on 127.0.0.1:``port``; its output in a temporary file (``headless_log``)."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom.cli", "serve", model, *args, "--headless",
         "--data-parallel-size", str(size), "--data-parallel-size-local", "1",
         "--data-parallel-start-rank", str(rank), "--data-parallel-address", "127.0.0.1",
         "--data-parallel-rpc-port", str(port)],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.log = log
    return proc


def headless_log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


class LoomServer:
    """``loom serve MODEL --port 0 ...``; waits for its "ready on" line."""

    def __init__(self, model: str | None, *args: str, api_key: str | None = None,
                 startup_timeout: float = 180.0, env: dict[str, str] | None = None,
                 cwd: str = REPO_ROOT) -> None:
        command = [sys.executable, "-m", "loom.cli", "serve"]
        if model is not None:
            command.append(model)
        command += ["--port", "0", *args]
        if api_key is not None:
            command += ["--api-key", api_key]
        self.api_key = api_key
        self._stderr = tempfile.NamedTemporaryFile("w+", prefix="loom-serve-", suffix=".log")
        self.stdout_lines: list[str] = []
        self.proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, bufsize=1,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"loom serve did not become ready:\n{self.output()}")
        self.base_url = f"{self.url}/v1"

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            match = _READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(),
                            timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused",
                             max_retries=0, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metric(self, name: str) -> float:
        """The value of a metric with only the model_name label, e.g. vllm:num_requests_running."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not in /metrics")

    def metric_by_replica(self, name: str) -> dict[str, float]:
        """{replica: value} of a metric of a data-parallel server, summed over its other
        labels."""
        values: dict[str, float] = {}
        text = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                replica = re.search(r'replica="(\d+)"', line).group(1)
                values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    def wait_for_metric(self, name: str, value: float, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            current = self.metric(name)
            if current == value or time.monotonic() > deadline:
                return current
            time.sleep(0.05)

    def engine_core_process(self) -> psutil.Process:
        return _spawned_children(psutil.Process(self.proc.pid))[0]

    def worker_processes(self) -> list[psutil.Process]:
        return _spawned_children(self.engine_core_process())

    def output(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return "".join(self.stdout_lines) + self._stderr.read()

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        try:
            self.terminate(30)
        finally:
            self.kill()
            self._stderr.close()


def _spawned_children(process: psutil.Process) -> list[psutil.Process]:
    """Children started by multiprocessing's spawn (not its resource tracker)."""
    return [child for child in process.children()
            if any("spawn_main" in part for part in child.cmdline())]
