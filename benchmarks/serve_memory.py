"""`loom serve`'s memory by process and its start-up time, two source trees interleaved.

    git archive <before-commit> | tar -x -C /tmp/loom_before
    nice -n 19 python benchmarks/serve_memory.py --before /tmp/loom_before --after . \\
        --rounds 2 [--only memory]                 # RSS: load does not change it
    flock /tmp/loom-bench.lock python benchmarks/serve_memory.py --before /tmp/loom_before \\
        --after . --rounds 3 [--only startup]      # times: A/B ratios within one run only

Each round runs ``loom serve`` (the default model unless ``--model``; extra loom flags
after ``--``) from each tree in turn, ``PYTHONPATH`` at the tree, and measures:

- start-up: wall seconds from the command to ``/health`` 200, and the API server
  process's own CPU seconds until then (less swayed by other load than wall time);
- per process (API server, engine core, worker, resource tracker; psutil): RSS 3 s
  after ready (the KV cache populated) and the kernel's peak (``VmHWM``) once 16
  concurrent completions of 64 tokens have run, with the tree's summed RSS sampled
  every 50 ms during them (``tree peak``); then the API server's and the engine core's
  RSS after one JSON-schema request (the engine core loads the tokenizer for grammars);
- ``loom serve`` refusing a bad flag that needs the checkpoint's config
  (``--tensor-parallel-size 2``: the default model's 9 heads do not split): wall
  seconds to exit 2.

Prints the median of the rounds per tree and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil


def _env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree.resolve()))


def roles(pid: int) -> dict[str, psutil.Process]:
    """The server's processes by role: the API server, its child the engine core, the
    engine core's child the worker; multiprocessing's resource trackers apart."""
    found: dict[str, psutil.Process] = {}

    def visit(process: psutil.Process, depth: int) -> None:
        cmdline = " ".join(process.cmdline())
        tracker = "resource_tracker" in cmdline
        role = "resource tracker" if tracker else ("API server", "engine core", "worker",
                                                    "other")[min(depth, 3)]
        name = role
        while name in found:
            name += "'"
        found[name] = process
        for child in process.children():
            visit(child, depth + (not tracker))

    visit(psutil.Process(pid), 0)
    return found


def peak_rss(process: psutil.Process) -> int:
    with open(f"/proc/{process.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _get(url: str, timeout: float = 1.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def _complete(port: int, model: str, extra: dict | None = None) -> None:
    body = json.dumps({"model": model, "prompt": "Tell me about the sea.", "max_tokens": 64,
                       "ignore_eos": True, **(extra or {})}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=600).read()


def serve_once(tree: Path, port: int, extra: list[str], memory: bool) -> dict[str, float]:
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "loom.cli", "serve", "--port", str(port),
                               "--disable-log-requests", *extra], env=_env(tree), cwd=tree,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    figures: dict[str, float] = {}
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"loom serve ({tree}) exited with {server.returncode}:\n"
                                 f"{server.stderr.read().decode()[-2000:]}")
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        figures["start-up to /health 200, s"] = time.perf_counter() - started
        times = psutil.Process(server.pid).cpu_times()
        figures["API server CPU (user + system) to ready, s"] = times.user + times.system
        if not memory:
            return figures
        time.sleep(3.0)
        processes = roles(server.pid)
        for role, process in processes.items():
            figures[f"RSS {role}, MiB"] = process.memory_info().rss / 2**20
        figures["RSS all, MiB"] = sum(p.memory_info().rss for p in processes.values()) / 2**20
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        tree_peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                total = 0
                for process in processes.values():
                    try:
                        total += process.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
                tree_peak[0] = max(tree_peak[0], total)

        sampler = threading.Thread(target=sample)
        sampler.start()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda _: _complete(port, model), range(16)))
        done.set()
        sampler.join()
        for role, process in processes.items():
            figures[f"peak (VmHWM) {role}, MiB"] = peak_rss(process) / 2**20
        figures["tree peak under 16 requests, MiB"] = tree_peak[0] / 2**20
        _complete(port, model, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "object"}}}})
        for role in ("API server", "engine core"):
            figures[f"RSS {role} after a JSON-schema request, MiB"] = \
                processes[role].memory_info().rss / 2**20
        return figures
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(server.pid).children(recursive=True):
                child.kill()
            server.kill()
            server.wait()


def refuse_once(tree: Path) -> float:
    started = time.perf_counter()
    refused = subprocess.run([sys.executable, "-m", "loom.cli", "serve", "-tp", "2"],
                             env=_env(tree), cwd=tree, capture_output=True, text=True)
    if refused.returncode != 2:
        raise SystemExit(f"loom serve -tp 2 ({tree}) exited {refused.returncode}, not 2:\n"
                         f"{refused.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--only", choices=["memory", "startup"], default=None)
    parser.add_argument("--model", default=None, help="default: loom's default model")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"] + ([args.model] if args.model else [])
    trees = {"before": args.before, "after": args.after}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for round_index in range(args.rounds):
        for name, tree in trees.items():
            rows = serve_once(tree, args.port, extra, memory=args.only != "startup")
            if args.only != "memory":
                rows["serve -tp 2 refused (exit 2), s"] = refuse_once(tree)
            for key, value in rows.items():
                figures[name].setdefault(key, []).append(value)
            print(f"round {round_index + 1} {name}: " + ", ".join(
                f"{key} {value:.1f}" for key, value in rows.items()), file=sys.stderr, flush=True)
    print(f"| measure (median of {args.rounds}) | before | after | after / before |")
    print("|---|---:|---:|---:|")
    for key in figures["after"]:
        if key not in figures["before"]:
            continue
        before = statistics.median(figures["before"][key])
        after = statistics.median(figures["after"][key])
        print(f"| {key} | {before:,.1f} | {after:,.1f} | {after / before:.2f} |")


if __name__ == "__main__":
    main()
