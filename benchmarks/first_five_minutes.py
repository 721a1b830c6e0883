"""The first five minutes on the default model: memory and time to a first answer.

    python benchmarks/first_five_minutes.py [--cold] [--port 8123] [-- extra loom args]

Runs ``loom generate --prompt Hello`` (wall time) and ``loom serve`` (time until
/health answers 200, then the resident set of every process of the server: API
server, engine core, worker, measured with psutil), and prints one Markdown row
each, with wall time and CPU time (user + system of every process: on a loaded
machine wall time swings with the load, CPU time much less). ``--cold``
points LOOM_CACHE_DIR at an empty directory, so the native kernels compile and the
GGUF tokenizer is converted again (the default model still comes from the
installed package).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

LOOM = [sys.executable, "-m", "loom.cli"]


def time_generate(env: dict[str, str], extra: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one `loom generate`."""
    started, cpu_before = time.perf_counter(), _children_cpu()
    subprocess.run(LOOM + ["generate", "--prompt", "Hello", "--max-tokens", "16"] + extra,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started, _children_cpu() - cpu_before


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def serve_until_ready(env: dict[str, str], port: int, extra: list[str]) -> None:
    started = time.perf_counter()
    server = subprocess.Popen(LOOM + ["serve", "--port", str(port)] + extra, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"loom serve exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        ready_s = time.perf_counter() - started
        ready_cpu_s = tree_cpu_seconds(server.pid)
        time.sleep(3.0)  # the KV cache populated, start-up's transients settled
        rows = resident_sets(server.pid)
        print(f"| serve: time to /health 200 | {ready_s:.1f} s wall, {ready_cpu_s:.1f} s CPU |")
        for name, rss in rows:
            print(f"| serve: RSS {name} | {rss / 2**20:,.0f} MiB |")
        print(f"| serve: RSS all processes | {sum(rss for _, rss in rows) / 2**20:,.0f} MiB |")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        started = time.perf_counter()
        urllib.request.urlopen(request, timeout=60).read()
        print(f"| serve: first completion (16 tokens) | {time.perf_counter() - started:.2f} s |")
        rows = resident_sets(server.pid)
        print(f"| serve: RSS all processes after it | "
              f"{sum(rss for _, rss in rows) / 2**20:,.0f} MiB |")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def tree_cpu_seconds(pid: int) -> float:
    """User + system seconds of the server and its descendants so far (a process
    that already exited, e.g. a compiler, is not counted)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root] + root.children(recursive=True):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def resident_sets(pid: int) -> list[tuple[str, int]]:
    """(role, RSS) of the server process and its descendants: the API server, its
    child the engine core, the engine core's child the worker (and each one's
    multiprocessing resource tracker)."""
    root = psutil.Process(pid)
    roles = {0: "API server", 1: "engine core", 2: "worker"}
    rows = []
    def visit(process: psutil.Process, depth: int) -> None:
        try:
            cmdline = " ".join(process.cmdline())
            rss = process.memory_info().rss
            children = process.children()
        except psutil.NoSuchProcess:
            return
        role = "resource tracker" if "resource_tracker" in cmdline else roles.get(depth, "other")
        rows.append((f"{role} (pid {process.pid})", rss))
        for child in children:
            visit(child, depth + (role != "resource tracker"))
    visit(root, 0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold", action="store_true", help="empty LOOM_CACHE_DIR")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    env = dict(os.environ)
    print("| measure | value |\n|---|---|")
    if not args.skip_generate:
        if args.cold:
            env["LOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="loom-cold-")
        wall, cpu = time_generate(env, extra)
        print(f"| generate --prompt Hello | {wall:.1f} s wall, {cpu:.1f} s CPU |")
    if not args.skip_serve:
        if args.cold:
            env["LOOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="loom-cold-")
        serve_until_ready(env, args.port, extra)


if __name__ == "__main__":
    main()
