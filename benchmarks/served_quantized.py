"""Served: `loom serve` against `llama-server` on the same quantized GGUF file.

    python benchmarks/served_quantized.py                      # the default Q4_1 file
    python benchmarks/served_quantized.py --concurrency 1 32 --repeats 3

Both servers load the very file users have (loom keeps its quantized formats, the
`--quantization auto` default) and stay up side by side; each repeat loads them in
turn, in an order rotated every repeat, with `loom bench serve` (random 128-token
prompts, 128 output tokens, `ignore_eos`, streaming). Reported per engine and
concurrency: medians over repeats of output tokens/s, TTFT and TPOT, and the peak
resident memory of each server's whole process tree (loom: the API server, engine core
and worker; llama-server: one process), sampled while it serves. loom's KV cache holds
the tokens llama-server's ``-c`` gives its slots.

llama.cpp comes from benchmarks/setup_baselines.sh (``$LOOM_BENCH_ENVS/llama.cpp/bin``).
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from quantized import kv_cache_bytes, tree_rss  # noqa: E402
from run_all import _free_port, _stop, wait_ready  # noqa: E402

ENGINES = ("loom", "llamacpp")


def server_command(engine: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    slots = max(args.concurrency)
    context = slots * (args.input_len + args.output_len + 16)
    if engine == "loom":
        # The KV cache llama-server is given (its -c), so the trees' memory compares like
        # for like; loom's CPU default would be up to 512 MiB.
        return [sys.executable, "-m", "loom.cli", "serve", model, "--port", str(port),
                "--served-model-name", "m", "--max-num-seqs", str(slots),
                "--kv-cache-memory", str(kv_cache_bytes(model, context)),
                "--disable-log-requests"]
    return [os.path.join(args.llama_bin, "llama-server"), "-m", model, "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
            "-c", str(context), "--alias", "m", "--no-webui"]


def serve_once(port: int, server_pid: int, model: str, concurrency: int, seed: int,
               args: argparse.Namespace) -> dict[str, Any]:
    """One `loom bench serve` run; its metrics and the server tree's peak RSS meanwhile."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(server_pid))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "serve.json")
        try:
            subprocess.run([
                sys.executable, "-m", "loom.cli", "bench", "serve",
                "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                "--tokenizer", model, "--num-prompts", str(concurrency * args.prompts_per_client),
                "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len),
                "--max-concurrency", str(concurrency), "--num-warmups", "2",
                "--seed", str(seed), "--disable-tqdm", "--result-file", result_file],
                check=True, timeout=900, stdout=subprocess.DEVNULL)
        finally:
            done.set()
            sampler.join()
        with open(result_file) as f:
            record = json.load(f)
    return {"output_tokens_per_s": record["output_throughput"],
            "median_ttft_ms": record["median_ttft_ms"],
            "median_tpot_ms": record["median_tpot_ms"],
            "completed": record["completed"],
            "peak_rss_mib": peak[0] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--prompts-per-client", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = default_model_path()
    engines = args.engines.split(",")

    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    logs = tempfile.mkdtemp(prefix="served-quantized-")
    try:
        for engine in engines:
            port = _free_port()
            with open(os.path.join(logs, f"{engine}.log"), "w") as log:
                proc = subprocess.Popen(server_command(engine, args.model, port, args),
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            started = time.monotonic()
            if not wait_ready(port, proc, 300, interval_s=0.5):
                raise SystemExit(f"{engine} did not start; see {logs}/{engine}.log")
            print(f"{engine} ready in {time.monotonic() - started:.1f} s, idle RSS "
                  f"{tree_rss(proc.pid) / 2**20:.0f} MiB", flush=True)
            servers[engine] = (proc, port)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            e: {c: [] for c in args.concurrency} for e in engines}
        for rep in range(args.repeats):
            order = engines[rep % len(engines):] + engines[:rep % len(engines)]
            for concurrency in args.concurrency:
                for engine in order:
                    proc, port = servers[engine]
                    row = serve_once(port, proc.pid, args.model, concurrency, rep, args)
                    runs[engine][concurrency].append(row)
                    print(f"repeat {rep} {engine} c={concurrency}: {json.dumps(row)}", flush=True)
    finally:
        for proc, _ in servers.values():
            _stop(proc)

    medians: dict[str, Any] = {}
    for engine in engines:
        for concurrency, rows in runs[engine].items():
            medians[f"{engine}_c{concurrency}"] = {
                key: statistics.median(r[key] for r in rows) if key != "peak_rss_mib"
                else max(r[key] for r in rows) for key in rows[0]}
    ratios = {f"loom_over_llamacpp_c{c}": medians[f"loom_c{c}"]["output_tokens_per_s"]
              / medians[f"llamacpp_c{c}"]["output_tokens_per_s"]
              for c in args.concurrency if set(ENGINES) <= set(engines)}
    report = {"model": args.model, "threads": args.threads, "repeats": args.repeats,
              "input_len": args.input_len, "output_len": args.output_len,
              "medians": medians, "ratios": ratios, "runs": runs}
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
