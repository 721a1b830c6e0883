"""Two builds of loom's paged attention kernel A/B, a fresh process per measurement.

    git archive <commit> loom/kernels/csrc | tar -x -C /tmp/old   # build A's sources
    python benchmarks/attention_ab.py /tmp/old/loom/kernels/csrc --rounds 3

Each build is compiled (or found in the cache) as loom builds it; then for every case
(one layer's attention over a shuffled bf16 block pool, SmolLM2-135M's heads or the
1B-class checkpoint's) the builds alternate, each timed in its own process (two builds
of one extension module do not load side by side), the minimum of ``--repeats`` calls.
Prints per case each build's median time over the rounds and the median of the rounds'
ratios B / A (below 1: B is faster), with the multiply-adds per second of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SMOLLM2 = (9, 3, 64)
ONE_B = (32, 8, 64)
# name, heads (query, KV, head size), context, new tokens
CASES = [
    ("decode, SmolLM2, context 256", SMOLLM2, 256, 1),
    ("decode, SmolLM2, context 2048", SMOLLM2, 2048, 1),
    ("decode, 1B, context 256", ONE_B, 256, 1),
    ("decode, 1B, context 4096", ONE_B, 4096, 1),
    ("decode, 1B, context 16384", ONE_B, 16384, 1),
    ("prefill 128, SmolLM2", SMOLLM2, 128, 128),
    ("chunk 1024 over 4096, 1B", ONE_B, 4096, 1024),
    ("chunk 512 over 16384, 1B", ONE_B, 16384, 512),
]


def build_path(csrc: Path) -> str:
    """The built module of ``csrc`` (compiled now if the cache lacks it)."""
    import loom.kernels as kernels

    kernels._CSRC = csrc
    assert kernels._load() is not None, f"the kernels in {csrc} did not build"
    # (a second build loaded in this process is the first module again: name its file)
    return str(kernels._build_dir() / "loom_cpu_ops.so")


def child(path: str, case: int, repeats: int, threads: int) -> None:
    import importlib.util

    import torch

    torch.set_num_threads(threads)
    spec = importlib.util.spec_from_file_location("loom_cpu_ops", path)
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    _, (heads, kv_heads, head_dim), context, new = CASES[case]
    torch.manual_seed(0)
    block_size = 16
    num_blocks = -(-context // block_size)
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim).to(torch.bfloat16)
    table = torch.randperm(num_blocks).to(torch.int32)[None, :].contiguous()
    q = torch.randn(new, heads, head_dim).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.tensor([context], dtype=torch.int32)
    starts = torch.tensor([0, new], dtype=torch.int32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ops.paged_attention(out, q, cache, table, lens, starts, head_dim ** -0.5, 1 << 30)
        times.append(time.perf_counter() - start)
    macs = heads * head_dim * 2 * sum(context - new + j + 1 for j in range(new))
    print(json.dumps({"s": min(times[1:]), "macs": macs}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csrc_a", type=Path, nargs="?", help="build A's csrc/ directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON of every round")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, case, repeats, threads = args.child
        child(path, int(case), int(repeats), int(threads))
        return
    from loom.kernels import _CSRC

    builds = {"A": build_path(args.csrc_a.resolve()), "B": build_path(_CSRC)}
    assert builds["A"] != builds["B"], "build A's sources are this checkout's"
    print(f"A: {builds['A']}\nB: {builds['B']}\nthreads {args.threads}\n")
    print("| case | A median | B median | B / A (median of rounds) | A, B GMAC/s |")
    print("|---|---|---|---|---|")
    results = []
    for i, (name, _, context, new) in enumerate(CASES):
        repeats = 200 if new == 1 else 5
        times: dict[str, list[float]] = {"A": [], "B": []}
        macs = 0
        for r in range(args.rounds):
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", builds[label], str(i), str(repeats),
                     str(args.threads)], capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                times[label].append(row["s"])
                macs = row["macs"]
        ratio = statistics.median(b / a for a, b in zip(times["A"], times["B"]))
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        results.append({"case": name, "a_s": times["A"], "b_s": times["B"], "ratio": ratio})
        print(f"| {name} | {a * 1e6:.0f} us | {b * 1e6:.0f} us | {ratio:.2f} | "
              f"{macs / a / 1e9:.0f}, {macs / b / 1e9:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"a": str(args.csrc_a), "threads": args.threads, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
