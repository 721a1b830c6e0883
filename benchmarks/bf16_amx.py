"""bf16_linear with and without the AMX tiles, beside oneDNN, and what it does to a model.

    python benchmarks/bf16_amx.py [--repeats 3] [--model PATH] [--skip-model]

Kernels: for each shape and row count, loom's ``bf16_linear`` (its AVX-512 micro-kernel
with ``LOOM_AMX=0``, the tiles with ``LOOM_AMX=1``) and oneDNN's ``F.linear`` on the
plain weight (which uses AMX itself where it can), in child processes that alternate
A, B, A, B (the switch is read once per process); medians of ``--repeats``. Model:
``loom bench latency`` on the default model in bf16 (``--quantization none``), prompt
128, batch 1, 8 and 32, alternating ``LOOM_AMX=0`` and ``1``. Results in
benchmarks/results/bf16_amx.json; written up in benchmarks/cpu_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [(1536, 576), (576, 1536), (2048, 1024), (16384, 2048), (2048, 8192)]
ROWS = [1, 8, 32, 128, 512]


def child() -> None:
    import torch
    import torch.nn.functional as F

    from loom.kernels import native_ops

    ops = native_ops()
    results = {"amx": ops.bf16_amx_available()}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        runs = max(3, int(0.2 / max(_once(fn), 1e-5)))
        started = time.perf_counter()
        for _ in range(runs):
            fn()
        return (time.perf_counter() - started) / runs * 1e3

    for n, k in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16)
        packed = ops.pack_bf16_weight(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            out = torch.empty(rows, n, dtype=torch.bfloat16)
            results[f"{n}x{k} rows {rows} loom"] = timed(lambda: ops.bf16_linear(out, x, packed))
            results[f"{n}x{k} rows {rows} onednn"] = timed(lambda: F.linear(x, weight))
    print(json.dumps(results))


def _once(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_child(amx: str) -> dict:
    env = {**os.environ, "LOOM_AMX": amx}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_model(amx: str, model: str | None) -> dict:
    env = {**os.environ, "LOOM_AMX": amx}
    command = [sys.executable, "-m", "loom.cli", "bench", "latency", "--quantization", "none",
               "--input-len", "128", "--output-len", "32", "--batch-size", "1", "8", "32",
               "--num-iters", "2"] + (["--model", model] if model else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    figures = {}
    for line in (done.stdout + done.stderr).splitlines():
        match = re.search(r"Latency \(batch (\d+),.*prefill [\d.]+ ms \(([\d.]+) tok/s\), "
                          r"decode step ([\d.]+) ms", line)
        if match:
            batch = match[1]
            figures[f"b{batch} prefill tok/s"] = float(match[2])
            figures[f"b{batch} decode tok/s"] = int(batch) * 1000 / float(match[3])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bf16_amx.json"))
    args = parser.parse_args()
    if args.child:
        child()
        return
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    models: dict[str, list[dict]] = {"0": [], "1": []}
    for repeat in range(args.repeats):
        for amx in ("0", "1") if repeat % 2 == 0 else ("1", "0"):
            runs[amx].append(run_child(amx))
            if not args.skip_model:
                models[amx].append(run_model(amx, args.model))
    median = {amx: {key: statistics.median(run[key] for run in results)
                    for key in results[0] if key != "amx"}
              for amx, results in runs.items()}
    print(f"AMX granted: {runs['1'][0]['amx']}")
    print("| shape (N x K) | rows | AVX-512 ms | AMX ms | oneDNN ms | AVX-512 / AMX |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, k in SHAPES:
        for rows in ROWS:
            key = f"{n}x{k} rows {rows}"
            avx, amx, onednn = (median["0"][key + " loom"], median["1"][key + " loom"],
                                median["1"][key + " onednn"])
            print(f"| {n} x {k} | {rows} | {avx:.3f} | {amx:.3f} | {onednn:.3f} | "
                  f"{avx / amx:.2f}x |")
    model_median = {}
    if not args.skip_model:
        model_median = {amx: {key: statistics.median(r[key] for r in results)
                              for key in results[0]} for amx, results in models.items()}
        print("| model figure | LOOM_AMX=0 | LOOM_AMX=1 | ratio |")
        print("|---|---:|---:|---:|")
        for key in model_median["0"]:
            off, on = model_median["0"][key], model_median["1"][key]
            print(f"| {key} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"kernels": median, "model": model_median, "raw": runs,
                   "raw_model": models}, f, indent=1)


if __name__ == "__main__":
    main()
