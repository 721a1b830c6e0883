"""Data parallel and the router, measured side by side in one run (benchmarks/router.md).

    python benchmarks/router.py [--model PATH] [--result-file benchmarks/results/router.json]

1. The router's added latency: one ``loom serve``, and ``loom router`` in front of it;
   ``--latency-requests`` small completions (``max_tokens`` 1, greedy, 8-token
   prompts), sent one at a time, alternating direct and through the router, so both
   see the same machine. p50/p99 of each, and the difference.
2. The router's throughput ceiling: ``--ceiling-clients`` clients sending the same
   small requests as fast as they can for ``--ceiling-seconds``, direct and through the
   router (one after the other); requests/s of each, and the router process's CPU
   seconds per request (its ceiling on one core is the inverse: the backend, not the
   router, limits the achieved rate when that is far above it).
3. Data parallel: ``--data-parallel-size 2 --cpu-threads-per-rank 1`` against one
   replica with ``--cpu-threads-per-rank 2``, each under ``loom bench serve`` at 8 and
   32 clients (random prompts of ``--input-len`` tokens, ``--output-len`` tokens out,
   2 x clients requests), the two servers taking turns; output tokens/s, TTFT and
   TPOT medians, and the resident memory of every process of each server.
4. Prefix affinity (``--skip router,dp`` to run it alone): ``--data-parallel-size 2``
   with ``--routing-policy affinity`` against ``--routing-policy load``, the two servers
   taking turns, on a shared-prefix workload: ``--prefixes`` system prompts of about
   ``--prefix-tokens`` tokens, ``--questions`` questions each, sent interleaved by
   ``--affinity-clients`` streaming clients. The replicas' prefix-cache hit rate (hits /
   queried tokens, from /metrics), TTFT median and p90 (first streamed token) and
   requests/s and output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READY = re.compile(r"ready on (https?://\S+)")


class Process:
    """A ``loom`` command that prints "ready on URL"; its whole process tree."""

    def __init__(self, *args: str, timeout: float = 600.0) -> None:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="loom-bench-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, start_new_session=True)
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                match = _READY.search(line)
                if match:
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"loom {' '.join(args)} did not start")

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root] + root.children(recursive=True)

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of each process of the tree, by a readable name."""
        sizes = {}
        for index, process in enumerate(self.tree()):
            try:
                cmdline = " ".join(process.cmdline())
                rss = process.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
            if "resource_tracker" in cmdline:
                continue
            name = ("api server" if index == 0 else
                    f"pid {process.pid} ({process.name()}, parent {process.ppid()})")
            sizes[name] = round(rss, 1)
        return sizes

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    child.kill()
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _serve(model: str, *args: str) -> Process:
    return Process("serve", model, "--port", "0", "--disable-log-stats", *args)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


SMALL = {"prompt": "The quick brown fox jumps over the", "max_tokens": 1, "temperature": 0.0}


def router_latency(direct: str, routed: str, num_requests: int) -> dict:
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as client:
        for url in (direct, routed):  # warm both paths
            for _ in range(5):
                client.post(f"{url}/v1/completions", json=SMALL).raise_for_status()
        for i in range(num_requests):
            for name, url in (("direct", direct), ("router", routed))[::1 if i % 2 else -1]:
                started = time.perf_counter()
                client.post(f"{url}/v1/completions", json=SMALL).raise_for_status()
                times[name].append(time.perf_counter() - started)
    result = {}
    for name, values in times.items():
        result[name] = {"p50_ms": round(1e3 * statistics.median(values), 2),
                        "p99_ms": round(1e3 * _percentile(values, 99), 2)}
    result["added_p50_ms"] = round(result["router"]["p50_ms"] - result["direct"]["p50_ms"], 2)
    result["added_p99_ms"] = round(result["router"]["p99_ms"] - result["direct"]["p99_ms"], 2)
    result["requests_each"] = num_requests
    return result


async def _hammer(url: str, clients: int, seconds: float) -> tuple[int, int]:
    done, failed = 0, 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def one_client() -> None:
            nonlocal done, failed
            while time.perf_counter() < deadline:
                response = await client.post(f"{url}/v1/completions", json=SMALL)
                if response.status_code == 200:
                    done += 1
                else:
                    failed += 1

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return done, failed


def router_ceiling(direct: str, router: Process, clients: int, seconds: float) -> dict:
    result = {"clients": clients, "seconds": seconds}
    for name, url in (("direct", direct), ("router", router.url)):
        cpu_before = router.cpu_seconds()
        started = time.perf_counter()
        done, failed = asyncio.run(_hammer(url, clients, seconds))
        elapsed = time.perf_counter() - started
        result[name] = {"requests_per_s": round(done / elapsed, 1), "failed": failed}
        if name == "router":
            cpu = router.cpu_seconds() - cpu_before
            result["router_cpu_ms_per_request"] = round(1e3 * cpu / max(done, 1), 3)
            result["router_ceiling_requests_per_s_one_core"] = round(done / max(cpu, 1e-9), 1)
    result["router_over_direct"] = round(result["router"]["requests_per_s"]
                                         / result["direct"]["requests_per_s"], 3)
    return result


def bench_serve(url: str, model: str, clients: int, input_len: int, output_len: int,
                seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "loom.cli", "bench", "serve", "--base-url", url,
                        "--num-prompts", str(2 * clients), "--max-concurrency", str(clients),
                        "--tokenizer", model, "--random-input-len", str(input_len),
                        "--random-output-len",
                        str(output_len), "--seed", str(seed), "--disable-tqdm",
                        "--result-file", out.name], cwd=REPO_ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        record = json.load(open(out.name))
    keep = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
            "p99_ttft_ms", "p99_tpot_ms", "completed", "failed")
    return {key: record[key] for key in keep if key in record}


def data_parallel(model: str, client_counts: list[int], input_len: int, output_len: int,
                  rounds: int) -> dict:
    setups = {"dp1_2threads": ("--cpu-threads-per-rank", "2"),
              "dp2_1thread": ("--data-parallel-size", "2", "--cpu-threads-per-rank", "1")}
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in client_counts}
                                              for name in setups}
    memory: dict[str, dict] = {}
    for round_index in range(rounds):
        names = list(setups) if round_index % 2 == 0 else list(setups)[::-1]
        for name in names:
            server = _serve(model, "--max-num-seqs", "64", *setups[name])
            try:
                for clients in client_counts:
                    runs[name][clients].append(
                        bench_serve(server.url, model, clients, input_len, output_len,
                                    seed=100 * round_index + clients))
                memory[name] = server.rss_mib()
            finally:
                server.stop()
    result: dict = {"rounds": rounds, "input_len": input_len, "output_len": output_len,
                    "rss_mib_after_runs": memory}
    for clients in client_counts:
        entry = {}
        for name in setups:
            records = runs[name][clients]
            entry[name] = {key: round(statistics.median(r[key] for r in records), 2)
                           for key in records[0]}
        entry["dp2_over_dp1_output_throughput"] = round(
            entry["dp2_1thread"]["output_throughput"]
            / entry["dp1_2threads"]["output_throughput"], 3)
        result[f"{clients}_clients"] = entry
    return result


_WORDS = ("river stone light paper garden window music orange silver market winter "
          "station bridge cloud forest engine letter mirror candle valley harbor signal "
          "meadow lantern castle thunder pocket ribbon saddle marble feather compass").split()


def shared_prefix_prompts(num_prefixes: int, prefix_words: int, questions: int) -> list[str]:
    """``questions`` prompts for each of ``num_prefixes`` long system prompts, in one
    shuffled order (the same for both policies; in prefix order, a load-only router taking
    turns would send each prefix to the same replica by accident)."""
    import random

    rng = random.Random(7)
    prefixes = [f"System prompt {p}: you are assistant number {p}. "
                + " ".join(rng.choice(_WORDS) for _ in range(prefix_words)) + "\n"
                for p in range(num_prefixes)]
    prompts = [prefixes[p] + f"Question {q}: what is {rng.choice(_WORDS)} {q} for {p}?"
               for q in range(questions) for p in range(num_prefixes)]
    rng.shuffle(prompts)
    return prompts


def _prefix_cache_totals(url: str) -> tuple[float, float]:
    """(queried tokens, hit tokens), summed over every replica."""
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


async def _stream_all(url: str, prompts: list[str], clients: int, output_len: int) -> dict:
    ttfts: list[float] = []
    failed = 0
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one_client() -> None:
            nonlocal failed
            while not queue.empty():
                prompt = queue.get_nowait()
                body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                        "ignore_eos": True, "stream": True}
                started = time.perf_counter()
                first = None
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        failed += 1
                        await response.aread()
                        continue
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - started
                if first is not None:
                    ttfts.append(first)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    done = len(ttfts)
    return {"completed": done, "failed": failed, "seconds": round(elapsed, 2),
            "requests_per_s": round(done / elapsed, 3),
            "output_tokens_per_s": round(done * output_len / elapsed, 2),
            "median_ttft_ms": round(1e3 * statistics.median(ttfts), 1) if ttfts else None,
            "p90_ttft_ms": round(1e3 * _percentile(ttfts, 90), 1) if ttfts else None}


def prefix_affinity(model: str, num_prefixes: int, prefix_words: int, questions: int,
                    clients: int, output_len: int, rounds: int,
                    server_args: list[str]) -> dict:
    prompts = shared_prefix_prompts(num_prefixes, prefix_words, questions)
    policies = ("affinity", "load")
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    prefix_tokens = None
    for round_index in range(rounds):
        order = policies if round_index % 2 == 0 else policies[::-1]
        for policy in order:
            server = _serve(model, "--data-parallel-size", "2", "--cpu-threads-per-rank", "1",
                            "--routing-policy", policy, "--max-num-seqs", "64", *server_args)
            try:
                if prefix_tokens is None:
                    prefix = prompts[0].split("\nQuestion", 1)[0]
                    prefix_tokens = httpx.post(f"{server.url}/tokenize", json={
                        "prompt": prefix}, timeout=30).json()["count"]
                queried, hits = _prefix_cache_totals(server.url)
                record = asyncio.run(_stream_all(server.url, prompts, clients, output_len))
                queried_after, hits_after = _prefix_cache_totals(server.url)
                record["prefix_hit_rate"] = round(
                    (hits_after - hits) / max(queried_after - queried, 1.0), 4)
                runs[policy].append(record)
                print(json.dumps({"policy": policy, "round": round_index, **record}),
                      flush=True)
            finally:
                server.stop()
    result: dict = {"rounds": rounds, "prefixes": num_prefixes, "prefix_tokens": prefix_tokens,
                    "questions_per_prefix": questions, "clients": clients,
                    "output_len": output_len, "server_args": server_args, "runs": runs}
    for policy in policies:
        result[policy] = {key: round(statistics.median(r[key] for r in runs[policy]), 4)
                          for key in ("prefix_hit_rate", "requests_per_s",
                                      "output_tokens_per_s", "median_ttft_ms", "p90_ttft_ms")}
    result["affinity_over_load_requests_per_s"] = round(
        result["affinity"]["requests_per_s"] / result["load"]["requests_per_s"], 3)
    result["affinity_over_load_median_ttft"] = round(
        result["affinity"]["median_ttft_ms"] / result["load"]["median_ttft_ms"], 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: loom's default model")
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--ceiling-clients", type=int, default=32)
    parser.add_argument("--ceiling-seconds", type=float, default=15.0)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each DP setup")
    parser.add_argument("--prefixes", type=int, default=8, help="affinity: system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=400,
                        help="affinity: about this many tokens per system prompt")
    parser.add_argument("--questions", type=int, default=16,
                        help="affinity: questions per system prompt")
    parser.add_argument("--affinity-clients", type=int, default=16)
    parser.add_argument("--affinity-output-len", type=int, default=16)
    parser.add_argument("--affinity-server-args", default="",
                        help="affinity: more loom serve flags, e.g. '--max-model-len 1024 "
                             "--kv-cache-memory 48MiB': a KV cache too small for every prefix "
                             "at once, so that load-only routing evicts them")
    parser.add_argument("--skip", default="",
                        help="comma list of router,dp,affinity to skip")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = default_model_path()
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"model": args.model, "cores": len(os.sched_getaffinity(0)),
                    "load_average_at_start": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if "router" not in skip:
        backend = _serve(args.model)
        router = Process("router", "--port", "0", "--backend", backend.url)
        try:
            result["router_latency"] = router_latency(backend.url, router.url,
                                                      args.latency_requests)
            print(json.dumps(result["router_latency"]), flush=True)
            result["router_ceiling"] = router_ceiling(backend.url, router, args.ceiling_clients,
                                                      args.ceiling_seconds)
            print(json.dumps(result["router_ceiling"]), flush=True)
            result["router_rss_mib"] = router.rss_mib()
            result["backend_rss_mib"] = backend.rss_mib()
        finally:
            router.stop()
            backend.stop()
    if "dp" not in skip:
        result["data_parallel"] = data_parallel(
            args.model, [int(c) for c in args.clients.split(",")], args.input_len,
            args.output_len, args.rounds)
        print(json.dumps(result["data_parallel"]), flush=True)
    if "affinity" not in skip:
        # a word of _WORDS with its space is one token of SmolLM2's tokenizer (300 words:
        # 312 tokens with the header; the result gives the count)
        result["prefix_affinity"] = prefix_affinity(
            args.model, args.prefixes, args.prefix_tokens - 12, args.questions,
            args.affinity_clients, args.affinity_output_len, args.rounds,
            shlex.split(args.affinity_server_args))
        print(json.dumps(result["prefix_affinity"]), flush=True)
    result["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
