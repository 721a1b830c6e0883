"""loom against llama.cpp in short alternating bursts: decode speed paired within seconds.

    python benchmarks/interleaved.py --model F.gguf --batch 1 --pairs 10
    python benchmarks/interleaved.py --model F.gguf --batch 8 --pairs 6
    python benchmarks/interleaved.py --model Q4_0.gguf --hf-model DIR --quantization wint4

``benchmarks/quantized.py`` runs each engine's whole benchmark (minutes) before the
other's, so a pair can straddle two of this host's memory phases: its read test swings
between about 30 and 60 GB/s from one minute to the next, and batch-1 decode follows it.
Here loom stays loaded in this process, and each pair is one loom burst and one
llama.cpp burst back to back (order alternating between pairs), each decoding
``--tokens`` tokens after a ``--prompt``-token prompt (``--batch`` sequences), so both
see the same phase. Both sides report the same statistic: tokens decoded over the time
spent decoding them (loom: its decode steps' total; llama.cpp: ``llama-bench -p 0``'s
``avg_ts`` at batch 1, ``llama-batched-bench``'s ``speed_tg`` above it). A single
read test before each pair records the phase, and each side's weight reads are given as
a share of it (``*_of_read_test``: weight bytes a step reads, times steps per second,
over the read test's bytes per second). At batch 1, where a step is bound by those
bytes, that share says how close each engine comes to the memory's speed, and so how
far any ratio between them can go.

loom's process keeps glibc's freed heap for reuse (``memory.keep_freed_memory``), as
``loom bench latency`` and the served engine's process do: without it a batch-32 step's
activations page-fault afresh every step.

loom is idle while llama.cpp runs; the CPU time its process tree takes meanwhile is
reported (``loom_cpu_s_during_llamacpp``), so a loom that stole a core would show.

loom runs the GGUF file with ``--quantization auto`` (its formats kept) by default, or
``--hf-model`` (the same weights as a checkpoint: benchmarks/make_1b.py) with
``--quantization wint8|wint4|none``. Its KV cache is sized to the tokens llama.cpp is
given (``benchmarks/quantized.py``'s ``batched_context``). Results: ``--out`` (JSON)
and a line per pair on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants so far."""
    from benchmarks.quantized import tree_pids

    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def llamacpp_burst(bin_dir: str, model: str, threads: int, batch: int, prompt: int,
                   tokens: int) -> float:
    """llama.cpp's decode tokens/s for one burst."""
    if batch == 1:
        out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-p", "0",
                              "-n", str(tokens), "-r", "1", "-t", str(threads), "-o", "json"],
                             capture_output=True, text=True, timeout=900, check=True).stdout
        return json.loads(out[out.index("["):])[0]["avg_ts"]
    from benchmarks.quantized import batched_context

    out = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", model,
                          "-c", str(batched_context(batch)), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(batch),
                          "-t", str(threads), "--output-format", "jsonl"],
                         capture_output=True, text=True, timeout=1800, check=True).stdout
    for line in out.splitlines():
        if line.startswith("{") and '"pl"' in line:
            return json.loads(line)["speed_tg"]
    raise RuntimeError(f"llama-batched-bench printed no result:\n{out[-2000:]}")


def loom_burst(llm, batch: int, prompt: int, tokens: int, tag: str) -> float:
    """loom's decode tokens/s for one burst: fresh random prompts (no prefix-cache hits)."""
    import random

    from loom.bench.offline import _time_batch

    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(tag)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(batch)]
    _, steps, decoded = _time_batch(llm.engine, prompts, tokens + 1, tag)
    return decoded / sum(steps)


def loom_step_bytes(llm) -> int:
    """Bytes of weights a loom decode step reads (one rank, in this process): every
    weight as held (a packed copy in place of its source, the LM head's float32 copy in
    place of its table), but an untied embedding table, of which a step reads rows."""
    from loom.model.loader.model_loader import weight_bytes_by_dtype

    model = llm.engine.engine_core.executor.worker.model_runner.model
    held = weight_bytes_by_dtype(model)
    total = sum(size for name, size in held.items() if name != "packed")
    head = model.lm_head
    if getattr(head, "float32_weight", None) is not None:  # --lm-head-fp32: a copy read instead
        total -= sum(p.numel() * p.element_size() for p in head.parameters())
    if not getattr(model.config, "tie_word_embeddings", False):
        total -= sum(p.numel() * p.element_size() for p in model.model.embed_tokens.parameters())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF file llama.cpp runs")
    parser.add_argument("--hf-model", default=None,
                        help="the same weights as a checkpoint, for loom (with --quantization)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="threads of both engines (loom: torch's, in this process)")
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "interleaved.json"))
    args = parser.parse_args()
    import torch

    from benchmarks.quantized import batched_context, kv_cache_bytes, step_bytes, write_summary
    from benchmarks.roofline import measure_bandwidth
    from loom import LLM
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as `loom bench latency` and the served engine's process do
    torch.set_num_threads(args.threads)
    loom_model = args.hf_model or args.model
    started = time.perf_counter()
    llm = LLM(loom_model, quantization=args.quantization,
              max_model_len=max(512, args.prompt + args.tokens + 16),
              kv_cache_memory_bytes=kv_cache_bytes(args.model, batched_context(args.batch)))
    load_s = time.perf_counter() - started
    # what a step reads, for each side's share of the read test: weight bytes per step
    # times steps per second (tokens per second / batch) over the read test's bytes/s
    step_bytes_of = {"loom": loom_step_bytes(llm), "llamacpp": step_bytes(args.model)}
    pairs: list[dict[str, Any]] = []
    try:
        loom_burst(llm, args.batch, args.prompt, 8, "warm-up")
        for i in range(args.pairs):
            read_gb_s = measure_bandwidth(256, 2)["read_gb_s"]
            row: dict[str, Any] = {"read_gb_s": read_gb_s}
            for side in (("loom", "llamacpp") if i % 2 == 0 else ("llamacpp", "loom")):
                if side == "loom":
                    row["loom"] = loom_burst(llm, args.batch, args.prompt, args.tokens, f"p{i}")
                else:
                    before = tree_cpu_seconds(os.getpid())
                    row["llamacpp"] = llamacpp_burst(args.llama_bin, args.model, args.threads,
                                                     args.batch, args.prompt, args.tokens)
                    row["loom_cpu_s_during_llamacpp"] = tree_cpu_seconds(os.getpid()) - before
            row["ratio"] = row["loom"] / row["llamacpp"]
            for side, size in step_bytes_of.items():
                row[f"{side}_of_read_test"] = row[side] / args.batch * size / (read_gb_s * 1e9)
            pairs.append(row)
            print(f"pair {i}: loom {row['loom']:.1f} tok/s, llama.cpp {row['llamacpp']:.1f} "
                  f"tok/s, ratio {row['ratio']:.2f} (read {read_gb_s:.0f} GB/s, of which the "
                  f"weights' reads: loom {row['loom_of_read_test']:.0%}, llama.cpp "
                  f"{row['llamacpp_of_read_test']:.0%}; loom idle CPU "
                  f"{row['loom_cpu_s_during_llamacpp']:.2f} s)", flush=True)
    finally:
        llm.shutdown()
    ratios = [p["ratio"] for p in pairs]
    summary = {"model": args.model, "loom_model": loom_model, "quantization": args.quantization,
               "batch": args.batch, "prompt": args.prompt, "tokens": args.tokens,
               "threads": args.threads, "loom_load_s": load_s,
               "median_ratio": statistics.median(ratios),
               "median_loom_tokens_per_s": statistics.median(p["loom"] for p in pairs),
               "median_llamacpp_tokens_per_s": statistics.median(p["llamacpp"] for p in pairs),
               "ratios_above_1": sum(r > 1 for r in ratios),
               "step_bytes": step_bytes_of,
               "median_loom_of_read_test": statistics.median(
                   p["loom_of_read_test"] for p in pairs),
               "median_llamacpp_of_read_test": statistics.median(
                   p["llamacpp_of_read_test"] for p in pairs),
               "pairs": pairs}
    write_summary(summary, args.out, "pairs")


if __name__ == "__main__":
    main()
