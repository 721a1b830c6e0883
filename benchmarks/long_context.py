"""Long prompts, loom against llama.cpp on the same GGUF file: time to first token and
decode speed at depth, with the KV cache in bf16 and in int8 (llama.cpp's f16 and q8_0).

    python benchmarks/long_context.py --model llama-1b-random-q4_0.gguf \
        --lengths 4096 16384 --kv-cache-dtypes auto int8 --rounds 2

For each length and cache dtype, each round runs one loom process and two llama.cpp
processes (their order alternating between rounds), every one fresh, with its peak
resident memory (the process tree) sampled and the share of the CPU other processes
took while it ran (``others_cpu_share``: a figure others disturbed says so):

- loom (``--loom-child``): one request of ``length`` random prompt tokens and
  ``--decode-tokens`` tokens after it, through the offline engine: time to first
  token is its prefill steps' time (chunked at the engine's default step budget, as
  served), decode speed its decode steps' tokens over their time.
- llama.cpp: ``llama-bench -p length -n 0 -fa 1`` (prompt tokens/s, so time to first
  token = length / it) and ``llama-bench -p 0 -n decode_tokens -d length -fa 1``
  (decode tokens/s after a ``length``-token context), ``-ctk/-ctv f16`` or ``q8_0``.
  With ``--llama-one-pass`` (for 32k, where each llama.cpp prefill takes a quarter of an
  hour on two cores) one ``llama-batched-bench -npp length -ntg decode_tokens -npl 1``
  gives both from a single prefill: its ``t_pp`` is the time to first token, its
  ``speed_tg`` the decode speed at that depth.

An fp8 cache (``fp8_e4m3``, ``fp8_e5m2``) has no llama.cpp counterpart: it is paired with
llama.cpp's q8_0 cache, the other 8-bit one, and says so in its rows.

The checkpoint's own context (the 1B-class file's 4,096) is lifted with
``--hf-overrides '{"max_position_embeddings": N}'``: the weights are random, speed is
what is measured. Results: ``--out`` (JSON) and a line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LLAMA_CACHE_TYPE = {"auto": "f16", "bfloat16": "f16", "int8": "q8_0", "fp8_e4m3": "q8_0",
                    "fp8_e5m2": "q8_0"}


def loom_child(args: argparse.Namespace) -> None:
    """One loom measurement in this (fresh) process; a JSON line on stdout."""
    import random

    import torch

    from loom import LLM
    from loom.bench.offline import _time_batch

    torch.set_num_threads(args.threads)
    length = args.lengths[0]
    max_len = length + args.decode_tokens + 16
    llm = LLM(args.model, max_model_len=max_len, kv_cache_dtype=args.kv_cache_dtypes[0],
              hf_overrides={"max_position_embeddings": max(max_len, 4096)},
              enable_prefix_caching=False, num_gpu_blocks_override=max_len // 16 + 2,
              block_size=16)
    try:
        vocab = llm.get_tokenizer().vocab_size
        rng = random.Random(length)
        prompt = [rng.randrange(100, vocab - 100) for _ in range(length)]
        _time_batch(llm.engine, [prompt[:64]], 2, "warm-up")
        prefill_s, steps, decoded = _time_batch(llm.engine, [prompt], args.decode_tokens + 1,
                                                "long")
    finally:
        llm.shutdown()
    print(json.dumps({"ttft_s": prefill_s, "decode_tokens_per_s": decoded / sum(steps)}))


def busy_cpu_s() -> tuple[float, float, float]:
    """Now, the machine's busy CPU seconds so far, and this process's and its reaped
    children's (every engine process here is a child run to its end)."""
    import resource

    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    ours = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) \
        + sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    return time.monotonic(), busy, ours


def others_share(start: tuple, end: tuple) -> float:
    """The share of the machine's CPU that processes other than this one and its
    children took between ``start`` and ``end``: how disturbed a figure is."""
    wall, busy, ours = (b - a for a, b in zip(start, end))
    return round(max(0.0, busy - ours) / (wall * os.cpu_count()), 3)


def run_loom(args: argparse.Namespace, length: int, kv_dtype: str) -> dict[str, Any]:
    from benchmarks.quantized import run_measured

    out, rss, wall = run_measured(
        [sys.executable, os.path.abspath(__file__), "--loom-child", "--model", args.model,
         "--lengths", str(length), "--kv-cache-dtypes", kv_dtype,
         "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)],
        timeout=3600)
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {**result, "peak_rss_mib": rss / 2**20, "wall_s": wall}


def run_llamacpp(args: argparse.Namespace, length: int, kv_dtype: str) -> dict[str, Any]:
    from benchmarks.quantized import run_measured

    bench = os.path.join(args.llama_bin, "llama-bench")
    cache = LLAMA_CACHE_TYPE[kv_dtype]
    if args.llama_one_pass:
        return run_llamacpp_one_pass(args, length, cache)
    common = ["-m", args.model, "-fa", "1", "-r", "1", "--no-warmup", "-t", str(args.threads),
              "-ctk", cache, "-ctv", cache, "-o", "json"]
    out, rss_prompt, _ = run_measured([bench, "-p", str(length), "-n", "0", *common], 3600)
    prompt_ts = json.loads(out[out.index("["):])[0]["avg_ts"]
    out, rss_decode, _ = run_measured([bench, "-p", "0", "-n", str(args.decode_tokens),
                                       "-d", str(length), *common], 3600)
    decode_ts = json.loads(out[out.index("["):])[0]["avg_ts"]
    return {"ttft_s": length / prompt_ts, "decode_tokens_per_s": decode_ts,
            "peak_rss_mib": max(rss_prompt, rss_decode) / 2**20}


def run_llamacpp_one_pass(args: argparse.Namespace, length: int, cache: str) -> dict[str, Any]:
    """One llama-batched-bench run: the prompt's time and the decode speed after it."""
    from benchmarks.quantized import run_measured

    out, rss, _ = run_measured(
        [os.path.join(args.llama_bin, "llama-batched-bench"), "-m", args.model,
         "-c", str(length + args.decode_tokens + 16), "-b", "2048", "-ub", "512",
         "-npp", str(length), "-ntg", str(args.decode_tokens), "-npl", "1", "-fa", "on",
         "-ctk", cache, "-ctv", cache, "-t", str(args.threads), "--output-format", "jsonl"],
        7200)
    for line in out.splitlines():
        if line.startswith("{") and '"pl"' in line:
            result = json.loads(line)
            return {"ttft_s": result["t_pp"], "decode_tokens_per_s": result["speed_tg"],
                    "peak_rss_mib": rss / 2**20, "tool": "llama-batched-bench"}
    raise RuntimeError(f"llama-batched-bench printed no result:\n{out[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF file both engines run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int8"],
                        choices=sorted(LLAMA_CACHE_TYPE))
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-one-pass", action="store_true",
                        help="llama.cpp's prompt time and decode at depth from one "
                             "llama-batched-bench prefill, not two llama-bench runs")
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "long-context.json"))
    parser.add_argument("--loom-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loom_child:
        loom_child(args)
        return
    from benchmarks.quantized import write_summary
    from benchmarks.roofline import measure_bandwidth

    runs: list[dict[str, Any]] = []
    started = time.time()
    for length in args.lengths:
        for kv_dtype in args.kv_cache_dtypes:
            for round_ in range(args.rounds):
                read_gb_s = measure_bandwidth(256, 2)["read_gb_s"]
                row: dict[str, Any] = {"length": length, "kv_cache_dtype": kv_dtype,
                                       "round": round_, "read_gb_s": read_gb_s}
                order = ("loom", "llamacpp") if round_ % 2 == 0 else ("llamacpp", "loom")
                for side in order:
                    start = busy_cpu_s()
                    row[side] = (run_loom if side == "loom" else run_llamacpp)(
                        args, length, kv_dtype)
                    row[side]["others_cpu_share"] = others_share(start, busy_cpu_s())
                row["ttft_ratio"] = row["llamacpp"]["ttft_s"] / row["loom"]["ttft_s"]
                row["decode_ratio"] = (row["loom"]["decode_tokens_per_s"]
                                       / row["llamacpp"]["decode_tokens_per_s"])
                runs.append(row)
                print(f"{length} tokens, KV {kv_dtype}, round {round_}: time to first token "
                      f"loom {row['loom']['ttft_s']:.1f} s, llama.cpp "
                      f"{row['llamacpp']['ttft_s']:.1f} s ({row['ttft_ratio']:.2f}x); decode "
                      f"loom {row['loom']['decode_tokens_per_s']:.1f} tok/s, llama.cpp "
                      f"{row['llamacpp']['decode_tokens_per_s']:.1f} ({row['decode_ratio']:.2f}x); "
                      f"peak RSS loom {row['loom']['peak_rss_mib']:.0f} MiB, llama.cpp "
                      f"{row['llamacpp']['peak_rss_mib']:.0f} MiB (read test {read_gb_s:.0f} GB/s; "
                      f"others took {row['loom']['others_cpu_share']:.0%} / "
                      f"{row['llamacpp']['others_cpu_share']:.0%} of the CPU)",
                      flush=True)
    summary: dict[str, Any] = {"model": args.model, "threads": args.threads,
                               "decode_tokens": args.decode_tokens, "rounds": args.rounds,
                               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                               "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
                               "medians": {}, "runs": runs}
    for length in args.lengths:
        for kv_dtype in args.kv_cache_dtypes:
            rows = [r for r in runs if r["length"] == length and r["kv_cache_dtype"] == kv_dtype]
            summary["medians"][f"{length}/{kv_dtype}"] = {
                "ttft_ratio": statistics.median(r["ttft_ratio"] for r in rows),
                "decode_ratio": statistics.median(r["decode_ratio"] for r in rows),
                "loom_ttft_s": statistics.median(r["loom"]["ttft_s"] for r in rows),
                "llamacpp_ttft_s": statistics.median(r["llamacpp"]["ttft_s"] for r in rows),
                "loom_peak_rss_mib": max(r["loom"]["peak_rss_mib"] for r in rows),
                "llamacpp_peak_rss_mib": max(r["llamacpp"]["peak_rss_mib"] for r in rows)}
    write_summary(summary, args.out, "runs")


if __name__ == "__main__":
    main()
