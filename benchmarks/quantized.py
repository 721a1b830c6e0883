"""loom against llama.cpp on the same quantized GGUF file, interleaved, medians.

    python benchmarks/quantized.py                           # the default Q4_1 file
    python benchmarks/quantized.py --model F.gguf --repeats 5 --llama-bin DIR
    python benchmarks/quantized.py --model F.gguf --engines llamacpp,llamacpp-amx,loom-kept

``loom-wint8`` and ``loom-wint4`` run loom on ``--hf-model``, the same weights as a Hugging
Face checkpoint (benchmarks/make_1b.py's directory), quantized at load by
``--quantization wint8|wint4``; paired with llama.cpp on ``--model`` (its Q8_0 or Q4_0
file of those weights: the issue's "Q8_0/wint8 and Q4_0/wint4").

``llamacpp-amx`` is a second llama.cpp build (``--llama-amx-bin``, by default
``$LOOM_BENCH_ENVS/llama.cpp-amx/bin``: benchmarks/setup_baselines.sh llamacpp-amx, built
for this CPU with ggml's AMX kernels) measured like ``llamacpp``, so both builds sit
in one interleaved run.

Per repeat, in an order rotated each repeat:

- llama.cpp ``llama-bench`` (pp128: prompt processing; tg128: batch-1 decode) and
  ``llama-batched-bench`` (128-token prompts, 128 new tokens, `--batch` sequences: 32
  by default), 2 threads;
- ``loom bench latency`` on the file as users have it (``--quantization auto``: its
  Q4_0/Q4_1/Q8_0 tensors kept quantized) and dequantized to bf16 (``--quantization
  none``, loom before it kept GGUF tensors quantized), batch 1 and `--batch`, 128 in,
  128 out, its KV cache sized to the tokens llama-batched-bench is given
  (``batched_context``).

Each process's peak resident memory (its whole tree, sampled every 50 ms) is reported
beside its speed, and the batch-1 roofline: the bytes a decode step reads (every linear
weight and the LM head, as stored) over the read bandwidth measured in the same run.
llama.cpp comes from benchmarks/setup_baselines.sh (``$LOOM_BENCH_ENVS/llama.cpp/bin``);
it is a benchmark tool, never a dependency. Results: ``--out`` (JSON) and a table on
stdout, to be copied into benchmarks/quantized.md: each engine's medians, and loom's
ratios to llama.cpp taken within each repeat, then their median (``paired_ratios``: on
a host whose speed drifts over minutes, neighbours compare better than whole-run
medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants (those still running)."""
    pids, stack = [], [pid]
    while stack:
        p = stack.pop()
        pids.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run_measured(cmd: list[str], timeout: float) -> tuple[str, int, float]:
    """(stdout, peak tree RSS bytes, seconds) of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n{out[-2000:]}")
    return out, peak[0], time.perf_counter() - start


def run_llama_bench(bin_dir: str, model: str, threads: int) -> dict[str, Any]:
    out, rss, _ = run_measured([os.path.join(bin_dir, "llama-bench"), "-m", model, "-p", "128",
                                "-n", "128", "-t", str(threads), "-o", "json"], 900)
    rows = json.loads(out[out.index("["):])
    result: dict[str, Any] = {"peak_rss_mib": rss / 2**20}
    for row in rows:
        key = "pp128_tokens_per_s" if row.get("n_prompt") else "tg128_tokens_per_s"
        result[key] = row["avg_ts"]
    return result


def run_llama_batched(bin_dir: str, model: str, threads: int, batch: int) -> dict[str, Any]:
    out, rss, _ = run_measured([os.path.join(bin_dir, "llama-batched-bench"), "-m", model,
                                "-c", str(batched_context(batch)), "-b", "2048", "-ub", "512",
                                "-npp", "128", "-ntg", "128", "-npl", str(batch),
                                "-t", str(threads), "--output-format", "jsonl"], 1800)
    for line in out.splitlines():
        if line.startswith("{") and '"pl"' in line:
            row = json.loads(line)
            return {"batch": batch, "output_tokens_per_s": row["speed_tg"],
                    "prompt_tokens_per_s": row["speed_pp"], "peak_rss_mib": rss / 2**20}
    raise RuntimeError(f"llama-batched-bench printed no result:\n{out[-2000:]}")


def batched_context(batch: int) -> int:
    """Tokens of KV cache ``llama-batched-bench`` is given for ``batch`` sequences of 128 + 128
    tokens (its ``-c``); loom's KV cache is sized the same, so peak memory compares like for
    like."""
    return batch * 256 + 256


def kv_cache_bytes(model: str, tokens: int) -> int:
    """Bytes of a bf16 KV cache holding ``tokens`` tokens of ``model``, in loom's blocks of 16."""
    from loom.model.loader.hf_config import kv_cache_bytes_per_block, load_hf_config

    return -(-tokens // 16) * kv_cache_bytes_per_block(load_hf_config(model), 16, "bfloat16", 1)


def run_loom(model: str, quantization: str, batches: list[int]) -> dict[str, Any]:
    kv_bytes = kv_cache_bytes(model, batched_context(max(batches)))
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "latency.json")
        _, rss, _ = run_measured([sys.executable, "-m", "loom.cli", "bench", "latency",
                                  "--model", model, "--quantization", quantization,
                                  "--input-len", "128", "--output-len", "128",
                                  "--batch-size", *map(str, batches), "--num-iters", "2",
                                  "--max-model-len", "512", "--kv-cache-memory", str(kv_bytes),
                                  "--result-file", result_file],
                                 1800)
        with open(result_file) as f:
            record = json.load(f)
    result: dict[str, Any] = {"peak_rss_mib": rss / 2**20}
    for row in record["results"]:
        b = row["batch_size"]
        result[f"b{b}_decode_tokens_per_s"] = row["decode_tokens_per_s"]
        result[f"b{b}_output_tokens_per_s"] = row["output_tokens_per_s"]
        result[f"b{b}_prefill_tokens_per_s"] = row["prefill_tokens_per_s"]
    return result


def step_bytes(model: str) -> int:
    """Bytes a batch-1 decode step reads from the file's tensors: every 2-d weight but
    the embedding table, which the LM head reads whole when tied (one row otherwise)."""
    from loom.model.loader.gguf_loader import open_gguf

    tensors = open_gguf(model).tensors
    total = sum(info.num_bytes for info in tensors.values() if len(info.shape) == 2)
    if "output.weight" in tensors:
        total -= tensors["token_embd.weight"].num_bytes
    return total


def paired_ratios(runs: dict[str, list[dict[str, Any]]], batches: list[int]) -> dict[str, Any]:
    """loom over llama.cpp per repeat (the two ran minutes apart, in one repeat) and the
    median over repeats: on a loaded host whose speed drifts over minutes, a ratio of
    neighbours is steadier than a ratio of medians taken over the whole run."""
    pairs = {"b1_decode": ("b1_decode_tokens_per_s", "tg128_tokens_per_s"),
             "prompt": ("b1_prefill_tokens_per_s", "pp128_tokens_per_s")}
    pairs.update({f"b{b}_decode": (f"b{b}_decode_tokens_per_s", f"b{b}_output_tokens_per_s")
                  for b in batches})
    ratios: dict[str, Any] = {}
    for loom_name in ("loom-kept", "loom-bf16", "loom-wint8", "loom-wint4"):
        for llama_name in ("llamacpp", "llamacpp-amx"):
            rows = list(zip(runs.get(loom_name, []), runs.get(llama_name, [])))
            if not rows:
                continue
            per_repeat = {key: [mine[a] / theirs[b] for mine, theirs in rows
                                if a in mine and b in theirs]
                          for key, (a, b) in pairs.items()}
            ratios[f"{loom_name}/{llama_name}"] = {
                key: {"median": statistics.median(values), "per_repeat": values}
                for key, values in per_repeat.items() if values}
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch", type=int, nargs="+", default=[32],
                        help="batched decode sizes beside batch 1 (e.g. --batch 8 32)")
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    parser.add_argument("--llama-amx-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp-amx", "bin"))
    parser.add_argument("--engines", default="llamacpp,loom-kept,loom-bf16",
                        help="comma-separated: llamacpp, llamacpp-amx, loom-kept, loom-bf16, "
                             "loom-wint8, loom-wint4")
    parser.add_argument("--hf-model", default=None,
                        help="the same weights as a Hugging Face checkpoint directory "
                             "(loom-wint8, loom-wint4)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quantized.json"))
    args = parser.parse_args()
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = str(default_model_path())
    from benchmarks.roofline import measure_bandwidth

    engines = args.engines.split(",")
    loom_engines = {"loom-kept": "auto", "loom-bf16": "none", "loom-wint8": "wint8",
                    "loom-wint4": "wint4"}
    unknown = set(engines) - {"llamacpp", "llamacpp-amx", *loom_engines}
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}")
    if {"loom-wint8", "loom-wint4"} & set(engines) and args.hf_model is None:
        parser.error("loom-wint8 and loom-wint4 run on --hf-model (a checkpoint directory)")
    llama_bins = {"llamacpp": args.llama_bin, "llamacpp-amx": args.llama_amx_bin}
    for name, bin_dir in llama_bins.items():
        if name in engines and not os.path.exists(os.path.join(bin_dir, "llama-bench")):
            print(f"no llama.cpp at {bin_dir} (benchmarks/setup_baselines.sh "
                  f"{name}); skipping it",
                  file=sys.stderr)
            engines.remove(name)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    bandwidth = []
    for repeat in range(args.repeats):
        order = engines[repeat % len(engines):] + engines[:repeat % len(engines)]
        for name in order:
            if name in llama_bins:
                result = run_llama_bench(llama_bins[name], args.model, args.threads)
                for batch in args.batch:
                    result.update({f"b{batch}_{k}": v for k, v in run_llama_batched(
                        llama_bins[name], args.model, args.threads, batch).items()})
            else:
                model = args.hf_model if name in ("loom-wint8", "loom-wint4") else args.model
                result = run_loom(model, loom_engines[name], [1, *args.batch])
            runs[name].append(result)
            print(f"repeat {repeat} {name}: {json.dumps(result)}", flush=True)
        bandwidth.append(measure_bandwidth(512, 5)["read_gb_s"])
    medians = {name: {key: statistics.median(r[key] for r in rows if key in r)
                      for key in rows[0]} for name, rows in runs.items() if rows}
    bytes_per_step = step_bytes(args.model)
    read_gb_s = statistics.median(bandwidth)
    summary = {"model": args.model, "repeats": args.repeats, "threads": args.threads,
               "medians": medians, "paired_ratios": paired_ratios(runs, args.batch),
               "raw": runs, "step_bytes": bytes_per_step,
               "read_gb_s": read_gb_s,
               "roofline_tokens_per_s": read_gb_s * 1e9 / bytes_per_step}
    write_summary(summary, args.out, "raw")


def write_summary(summary: dict[str, Any], path: str, bulky: str) -> None:
    """The run's JSON to ``path``, and on stdout without its ``bulky`` key."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != bulky}, indent=2))


if __name__ == "__main__":
    main()
