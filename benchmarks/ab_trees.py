"""Two loom source trees, same machine, interleaved: decode step time at batch 1 and 32
(``loom bench latency``) and throughput over 256 mixed-length requests (``loom bench
throughput``), for a refactor that must not cost speed.

    git worktree add /tmp/loom_before <commit>
    python benchmarks/ab_trees.py --before /tmp/loom_before --after . --rounds 3 \\
        [--model DIR --tokenizer GGUF] [--only latency|throughput] \\
        [--batch-sizes 1 --num-iters 5] > benchmarks/results/ab.md

Each run is a fresh process with ``PYTHONPATH`` at its tree (its own ``loom``, its own
kernel build, cached by source hash), in the order before, after, before, after, ...
so drift on a loaded machine hits both. Reports the median of the rounds per tree and
the ratio after/before, with every process's peak resident memory (``ru_maxrss`` of
the child, which runs the engine in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(tree: Path, args: list[str]) -> tuple[dict, float]:
    """One ``loom bench`` in a fresh process on ``tree``: its result file, and the
    process's peak resident memory in MiB (the engine runs in it)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_file = handle.name
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    process = subprocess.Popen([sys.executable, "-m", "loom.cli", "bench", *args,
                                "--result-file", result_file], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"loom bench {args[0]} on {tree} failed:\n"
                         f"{process.stderr.read().decode()[-2000:]}")
    result = json.loads(Path(result_file).read_text())
    os.unlink(result_file)
    return result, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: loom's default model")
    parser.add_argument("--tokenizer", default=None,
                        help="for a random checkpoint without one: e.g. the default GGUF")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--only", choices=["latency", "throughput"], default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32],
                        help="decode batch sizes of the latency runs")
    parser.add_argument("--num-iters", type=int, default=3, help="latency iterations a run")
    args = parser.parse_args()
    common = ["--dtype", args.dtype, "--max-model-len", "1024"]
    if args.model:
        common += ["--model", args.model]
    if args.tokenizer:
        common += ["--tokenizer", args.tokenizer]
    latency = ["latency", *common, "--batch-size", *map(str, args.batch_sizes),
               "--input-len", "128", "--output-len", "64", "--num-iters", str(args.num_iters),
               "--num-iters-warmup", "1"]
    throughput = ["throughput", *common, "--num-prompts", "256", "--dataset-name", "random",
                  "--random-input-len", "128", "--random-output-len", "64",
                  "--random-range-ratio", "0.5", "--max-num-seqs", "64", "--disable-tqdm"]
    trees = {"before": args.before, "after": args.after}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for round_index in range(args.rounds):
        for name, tree in trees.items():
            if args.only != "throughput":
                result, rss = run(tree, latency)
                for row in result["results"]:
                    key = f"decode b={row['batch_size']} step ms"
                    figures[name].setdefault(key, []).append(row["median_decode_step_s"] * 1000)
                figures[name].setdefault("latency process peak RSS MiB", []).append(rss)
            if args.only != "latency":
                result, rss = run(tree, throughput)
                figures[name].setdefault("256 mixed output tok/s", []).append(
                    result["output_tokens_per_s"])
                figures[name].setdefault("throughput process peak RSS MiB", []).append(rss)
            print(f"round {round_index + 1} {name}: "
                  + ", ".join(f"{k} {v[-1]:.2f}" for k, v in figures[name].items()),
                  file=sys.stderr)
    print(f"model {args.model or 'default (SmolLM2-135M Q4_1 GGUF)'}, {args.dtype}, "
          f"{args.rounds} rounds interleaved, median per tree\n")
    # A round's two runs are a minute apart: their ratio is what drift on a loaded host
    # disturbs least (the medians per tree can land on different phases of it).
    print("| figure | before | after | after / before | median of the rounds' ratios | "
          "before, each round | after, each round |")
    print("|---|---|---|---|---|---|---|")
    for key in figures["before"]:
        before = statistics.median(figures["before"][key])
        after = statistics.median(figures["after"][key])
        paired = statistics.median(a / b for a, b in zip(figures["after"][key],
                                                          figures["before"][key]))
        rounds = [" ".join(f"{v:.1f}" for v in figures[name][key]) for name in trees]
        print(f"| {key} | {before:.2f} | {after:.2f} | {after / before:.3f} | {paired:.3f} | "
              f"{rounds[0]} | {rounds[1]} |")


if __name__ == "__main__":
    main()
