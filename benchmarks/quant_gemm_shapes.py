"""The quantized and bf16 matmul kernels on a 1B Llama's layers: time and weight bandwidth.

    python benchmarks/quant_gemm_shapes.py [--formats Q4_0,Q8_0,Q6_K,Q4_K,wint8,wint4,bf16]
        [--rows 1,8,32] [--threads 2] [--repeats 5] [--out FILE]

For each format and each linear of Llama-3.2-1B's shapes (fused QKV 3072 x 2048, O 2048
x 2048, fused gate/up 16384 x 2048, down 2048 x 8192, and the 49,152 x 2048 LM head of
SmolLM2's vocabulary), random weights packed as loom holds them, ``quantized_linear``
(or ``bf16_linear``) on 1, 8, 32 rows: the median time of ``--repeats`` timed loops
and the weight bytes read per call over that time (GB/s). One process, the formats and
shapes interleaved each repeat; beside them the read bandwidth that
``benchmarks/roofline.py`` measures (a tensor sum), the ceiling a 1-row product can
reach. A 1-row figure near that ceiling means the kernel streams its weights at memory
speed; far below it, the unpacking instructions bound it.

Two builds cannot be compared in one process (both register the same pybind11 types):
``--baseline DIR`` (another checkout's ``loom/kernels/csrc``, e.g. ``git archive main
loom/kernels/csrc | tar -x -C /tmp/old``) runs each repeat twice, in two fresh processes,
this checkout's build and the baseline's, in alternating order, and prints both with the
ratio new / baseline per case, beside each build's ratio to its own bf16 kernel on the
same shape and rows (the bf16 kernel is the same code in both: its rows are the yardstick
of the load each process saw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (49152, 2048)}
# ggml type, (values per block, bytes per block), byte offsets of float16 scales
GGUF = {"Q4_0": (2, (32, 18), (0,)), "Q4_1": (3, (32, 20), (0, 2)),
        "Q8_0": (8, (32, 34), (0,)), "Q5_0": (6, (32, 22), (0,)),
        "Q4_K": (12, (256, 144), (0, 2)), "Q5_K": (13, (256, 176), (0, 2)),
        "Q6_K": (14, (256, 210), (208,))}


def random_weight(fmt: str, n: int, k: int, ops):
    """A random (n, k) weight of ``fmt`` as the kernel holds it, and its bytes."""
    if fmt == "bf16":
        packed = ops.pack_bf16_weight(torch.randn(n, k, dtype=torch.bfloat16) * 0.02)
        return packed, packed.numel() * 2
    if fmt.startswith("wint"):  # loom's own, quantized from bf16 (wint4 groups of 128)
        from loom.model.layers.quantization import quantize

        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.02
        packed = quantize(weight, fmt).pack(ops)
        return packed, packed.nbytes
    from loom.model.loader.gguf_quantized import gguf_quantized

    ggml_type, (values, size), scale_at = GGUF[fmt]
    rng = np.random.default_rng(n + k)
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for offset in scale_at:
        scales = (rng.standard_normal((n, k // values)) * 0.05).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    kept = gguf_quantized(raw.reshape(n, -1), ggml_type, (n, k))
    packed = kept.pack(ops)
    return packed, packed.nbytes


def measure(args) -> dict:
    """``args.repeats`` repeats of every case in this process: the times (s) per case, the
    weight bytes per (format, shape), the read bandwidth per repeat."""
    torch.set_num_threads(args.threads)
    import loom.kernels
    from benchmarks.roofline import measure_bandwidth

    if args.csrc:  # another checkout's kernels, built as loom builds them
        loom.kernels._CSRC = Path(args.csrc).resolve()
    ops = loom.kernels.native_ops()
    assert ops is not None, "the kernels did not build"
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    weights = {(f, s): random_weight(f, *SHAPES[s], ops) for f in formats for s in shapes}
    inputs = {(r, k): torch.randn(r, k, dtype=torch.bfloat16)
              for r in rows_list for k in {SHAPES[s][1] for s in shapes}}

    def call(fmt, shape, rows):
        n, k = SHAPES[shape]
        packed, _ = weights[(fmt, shape)]
        out = torch.empty(rows, n, dtype=torch.float32 if shape == "lm_head" else torch.bfloat16)
        x = inputs[(rows, k)]
        if fmt == "bf16":
            return lambda: ops.bf16_linear(out, x, packed, None)
        return lambda: ops.quantized_linear(out, x, packed, None)

    # --clock cpu: the process's CPU time, not the wall clock: on a loaded host a thread
    # waiting for a core costs no CPU time (with --threads 1, the kernel's own work and
    # what other processes' cache and memory traffic add to it)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {}
    bandwidth = []
    for repeat in range(args.repeats):
        for fmt in formats:
            for shape in shapes:
                for rows in rows_list:
                    fn = call(fmt, shape, rows)
                    fn()
                    started = clock()
                    fn()
                    once = clock() - started
                    loops = max(2, int(args.seconds / max(once, 1e-6)))
                    started = clock()
                    for _ in range(loops):
                        fn()
                    elapsed = (clock() - started) / loops
                    times.setdefault(f"{fmt} {shape} {rows}", []).append(elapsed)
        bandwidth.append(measure_bandwidth(512, 3, threads=args.threads)["read_gb_s"])
    return {"times": times, "bandwidth": bandwidth,
            "bytes": {f"{f} {s}": weights[(f, s)][1] for f in formats for s in shapes}}


def compare(args) -> None:
    """This checkout's build against ``args.baseline``'s, one fresh process per repeat
    and build, in alternating order (baseline first in odd repeats)."""
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    runs: dict[str, list[dict]] = {"new": [], "baseline": []}
    common = [sys.executable, os.path.abspath(__file__), "--worker", "--repeats", "1",
              "--formats", args.formats, "--shapes", args.shapes, "--rows", args.rows,
              "--threads", str(args.threads), "--seconds", str(args.seconds),
              "--clock", args.clock]
    for repeat in range(args.repeats):
        order = ("new", "baseline") if repeat % 2 == 0 else ("baseline", "new")
        for label in order:
            command = common + (["--csrc", args.baseline] if label == "baseline" else [])
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def median_ms(label, key):
        return statistics.median(t for run in runs[label] for t in run["times"][key]) * 1e3

    read_gb_s = statistics.median(b for label in runs for run in runs[label]
                                  for b in run["bandwidth"])
    print(f"new: {os.path.dirname(HERE)}/loom/kernels/csrc; baseline: {args.baseline}; "
          f"{args.repeats} repeats, alternating processes, {args.threads} threads, "
          f"{args.clock} clock; read bandwidth {read_gb_s:.1f} GB/s")
    print("| format | shape | rows | MB | baseline ms | new ms | new / baseline | "
          "baseline / bf16 | new / bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for fmt in formats:
        for shape in shapes:
            nbytes = runs["new"][0]["bytes"][f"{fmt} {shape}"]
            for rows in rows_list:
                key = f"{fmt} {shape} {rows}"
                new, old = median_ms("new", key), median_ms("baseline", key)
                row = {"new_ms": new, "baseline_ms": old, "weight_bytes": nbytes}
                ratios = ["", ""]
                if "bf16" in formats and fmt != "bf16":
                    bf16_key = f"bf16 {shape} {rows}"
                    row["baseline_over_bf16"] = old / median_ms("baseline", bf16_key)
                    row["new_over_bf16"] = new / median_ms("new", bf16_key)
                    ratios = [f"{row['baseline_over_bf16']:.2f}", f"{row['new_over_bf16']:.2f}"]
                table[key] = row
                print(f"| {fmt} | {shape} | {rows} | {nbytes / 1e6:.1f} | {old:.3f} | "
                      f"{new:.3f} | {new / old:.2f} | {ratios[0]} | {ratios[1]} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"read_gb_s": read_gb_s, "threads": args.threads,
                       "baseline": args.baseline, "repeats": args.repeats, "results": table,
                       "runs": runs}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_0,Q8_0,Q6_K,Q4_K,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.15, help="per timed loop")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: time.process_time (a loaded host: use with --threads 1)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--baseline", default=None,
                        help="another checkout's loom/kernels/csrc: A/B in alternating processes")
    parser.add_argument("--csrc", default=None, help=argparse.SUPPRESS)  # a worker's build
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        compare(args)
        return
    result = measure(args)
    if args.worker:  # one JSON line for compare()
        print(json.dumps(result))
        return
    times, bandwidth = result["times"], result["bandwidth"]
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    read_gb_s = statistics.median(bandwidth)
    table = {}
    print(f"read bandwidth (tensor sum, {args.threads} threads): {read_gb_s:.1f} GB/s")
    print(f"{'format':6} {'shape':8} {'rows':>4} {'ms':>8} {'GB/s':>6} {'% read':>6}")
    for fmt in formats:
        for shape in shapes:
            nbytes = result["bytes"][f"{fmt} {shape}"]
            for rows in rows_list:
                ms = statistics.median(times[f"{fmt} {shape} {rows}"]) * 1e3
                gb_s = nbytes / ms / 1e6
                table[f"{fmt} {shape} {rows}"] = {"ms": ms, "weight_gb_s": gb_s,
                                                  "weight_bytes": nbytes}
                print(f"{fmt:6} {shape:8} {rows:4d} {ms:8.3f} {gb_s:6.1f} "
                      f"{100 * gb_s / read_gb_s:5.0f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"read_gb_s": read_gb_s, "threads": args.threads, "results": table}, f,
                      indent=1)


if __name__ == "__main__":
    main()
