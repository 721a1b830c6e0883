"""quantized_linear A/B between two checkouts, interleaved in one run.

    flock /tmp/loom-bench.lock python benchmarks/quant_gemm_ab.py --baseline /work/main

Each checkout runs in its own worker process (its Python and its kernels, so the two may
differ in how they pack a GGUF tensor), 2 threads, one worker at a time: every repeat
asks both for the same case, in alternating order, and each answers with the mean time
of ``--calls`` calls. The table gives the medians and their ratio (this checkout over
the baseline). ``hot``: one weight, in L3 after the first call (the kernel's compute);
``stream``: copies of it cycled, 96 MiB in all, so each call reads from memory (a
model's decode step). Weights are random GGUF blocks (``quant_gemm_shapes.py``'s)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# ggml type, (values, bytes) per block, byte offsets of its float16 scales
GGUF = {"Q4_0": (2, (32, 18), (0,)), "Q4_1": (3, (32, 20), (0, 2)), "Q5_0": (6, (32, 22), (0,)),
        "Q8_0": (8, (32, 34), (0,)), "Q4_K": (12, (256, 144), (0, 2)),
        "Q5_K": (13, (256, 176), (0, 2)), "Q6_K": (14, (256, 210), (208,))}
STREAM_BYTES = 96 * 2 ** 20  # three times the host's L3


def worker() -> None:
    """Answer 'format n k rows calls mode' lines with 'seconds-per-call weight-bytes'."""
    import numpy as np
    import torch

    torch.set_num_threads(2)
    from loom.kernels import native_ops
    from loom.model.loader.gguf_quantized import gguf_quantized

    ops = native_ops()
    packed = {}

    def weight(fmt: str, n: int, k: int, copy: int):
        if (fmt, n, k, copy) not in packed:
            ggml_type, (values, size), scale_at = GGUF[fmt]
            rng = np.random.default_rng(n + k + 1000 * copy)
            raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
            for offset in scale_at:
                scales = (rng.standard_normal((n, k // values)) * 0.05).astype(np.float16)
                raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
            kept = gguf_quantized(raw.reshape(n, -1), ggml_type, (n, k))
            packed[(fmt, n, k, copy)] = kept.pack(ops) if hasattr(kept, "pack") else \
                ops.pack_quantized_weight(kept.values, kept.scales, kept.offsets, kept.bits)
        return packed[(fmt, n, k, copy)]

    print("ready", flush=True)
    for line in sys.stdin:
        fmt, n, k, rows, calls, mode = line.split()
        n, k, rows, calls = int(n), int(k), int(rows), int(calls)
        first = weight(fmt, n, k, 0)
        copies = 1 if mode == "hot" else -(-STREAM_BYTES // first.nbytes)
        weights = [weight(fmt, n, k, c) for c in range(copies)]
        x = torch.randn(rows, k).bfloat16()
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        for w in weights[:2]:
            ops.quantized_linear(out, x, w, None)
        start = time.perf_counter()
        for i in range(calls):
            ops.quantized_linear(out, x, weights[i % copies], None)
        print((time.perf_counter() - start) / calls, first.nbytes, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's root")
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--shapes", default="2048x8192,8192x2048", help="N x K")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--modes", default="hot,stream")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=12)
    args = parser.parse_args()
    roots = {"baseline": os.path.abspath(args.baseline), "new": os.path.dirname(HERE)}
    workers = {}
    for side, root in roots.items():
        env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="2")
        workers[side] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                         cwd=root, env=env, text=True, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
        assert workers[side].stdout.readline().strip() == "ready", f"{side} worker failed"
    cases = [(fmt, *map(int, shape.split("x")), int(rows), args.calls, mode)
             for mode in args.modes.split(",") for fmt in args.formats.split(",")
             for shape in args.shapes.split(",") for rows in args.rows.split(",")]
    times = {(case, side): [] for case in cases for side in workers}
    nbytes = {}
    for repeat in range(args.repeats):
        for case in cases:
            for side in (("baseline", "new") if repeat % 2 == 0 else ("new", "baseline")):
                workers[side].stdin.write(" ".join(map(str, case)) + "\n")
                workers[side].stdin.flush()
                seconds, size = workers[side].stdout.readline().split()
                times[(case, side)].append(float(seconds))
                nbytes[(case, side)] = int(size)
    print(f"baseline {roots['baseline']}, new {roots['new']}; medians of {args.repeats}")
    print("| format | N x K | rows | weights | baseline us | new us | new/baseline | bytes |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for case in cases:
        old = statistics.median(times[(case, "baseline")])
        new = statistics.median(times[(case, "new")])
        fmt, n, k, rows, _, mode = case
        print(f"| {fmt} | {n}x{k} | {rows} | {mode} | {old * 1e6:.0f} | {new * 1e6:.0f} | "
              f"{new / old:.3f} | {nbytes[(case, 'baseline')] / 2 ** 20:.1f} -> "
              f"{nbytes[(case, 'new')] / 2 ** 20:.1f} MiB |")
    for process in workers.values():
        process.stdin.close()
        process.wait()


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
