"""CPU per generated token of incremental detokenization: tokenizers' DecodeStream
(FastIncrementalDetokenizer, the default) against the Python path (IncrementalDetokenizer).

    # in this process, the detokenizers alone, on the default model's tokenizer
    python benchmarks/detokenizer.py micro --sequences 32 --tokens 256 --repeat 5

    # the API server's process (not its engine core or workers) under 32 streams
    python benchmarks/detokenizer.py serve --concurrency 32 --requests 64 --max-tokens 128 --threads 1

`serve` starts `loom serve` (default model) once per detokenizer, runs a warm-up round,
then `--repeat` rounds of `--requests` streamed completions (`ignore_eos`, so every
request makes `--max-tokens` tokens), `--concurrency` at a time, and reads the API
process's CPU time (user + system, psutil) around each round. The Python path is
selected by starting the server through a launcher that makes `make_detokenizer`
return `IncrementalDetokenizer`; the product has no switch for it.

Results: benchmarks/detokenizer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READY = re.compile(r"ready on (https?://\S+)")
_PYTHON_PATH_LAUNCHER = """
import sys
import loom.output_processor
from loom.detokenizer import IncrementalDetokenizer
loom.output_processor.make_detokenizer = IncrementalDetokenizer
from loom.cli import main
sys.exit(main(sys.argv[1:]))
"""
_FAST_PATH_LAUNCHER = "import sys\nfrom loom.cli import main\nsys.exit(main(sys.argv[1:]))\n"
PROMPTS = ["Write a short story about a dragon who learns to cook.",
           "Explain how a bicycle works to a child.",
           "List ten facts about the ocean, with numbers.",
           "Écris un poème sur la mer et le vent.",
           "用中文介绍一下长城的历史。",
           "Describe your favourite emoji 😀🎉 and why."]


def micro(args: argparse.Namespace) -> dict:
    from loom.default_model import default_model_path
    from loom.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer
    from loom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(0)
    # Real text (CJK, accents, emoji: characters split across byte tokens), one token per update.
    corpus = tokenizer.encode(" ".join(PROMPTS) * 200, add_special_tokens=False)
    sequences = []
    for _ in range(args.sequences):
        start = rng.randrange(len(corpus) - args.tokens)
        sequences.append(corpus[start:start + args.tokens])
    prompt_ids = tokenizer.encode(PROMPTS[0])
    results = {}
    for _ in range(args.repeat):
        for cls in (IncrementalDetokenizer, FastIncrementalDetokenizer):
            started = time.process_time()
            texts = []
            for output_ids in sequences:
                detokenizer = cls(tokenizer, prompt_ids)
                text = "".join(detokenizer.update([token_id]) for token_id in output_ids)
                texts.append(text + detokenizer.flush())
            elapsed = time.process_time() - started
            assert texts == [tokenizer.decode(ids) for ids in sequences]
            results.setdefault(cls.__name__, []).append(
                elapsed / (args.sequences * args.tokens) * 1e6)
    return {name: {"us_per_token_median": statistics.median(values), "runs": values}
            for name, values in results.items()}


class Server:
    def __init__(self, launcher: str, serve_args: list[str], env: dict[str, str]) -> None:
        command = [sys.executable, "-c", launcher, "serve", "--port", "0", *serve_args]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **env})
        self.url = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                match = _READY.search(line)
                if match:
                    self.url = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600):
            self.proc.kill()
            raise RuntimeError("loom serve did not become ready")

    def cpu_seconds(self) -> float:
        import psutil

        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _round(url: str, requests: int, concurrency: int, max_tokens: int,
                 stream: bool = True) -> int:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "temperature": 0.8}
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def one(client: httpx.AsyncClient, index: int) -> int:
        async with semaphore:
            if not stream:
                response = await client.post("/v1/completions", json={
                    **body, "prompt": PROMPTS[index % len(PROMPTS)], "seed": index})
                return response.json()["usage"]["completion_tokens"]
            tokens = 0
            async with client.stream("POST", "/v1/completions",
                                     json={**body, "prompt": PROMPTS[index % len(PROMPTS)],
                                           "seed": index}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens = usage["completion_tokens"]
            return tokens

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        counts = await asyncio.gather(*(one(client, i) for i in range(requests)))
    assert all(count == max_tokens for count in counts), counts
    return sum(counts)


def serve(args: argparse.Namespace) -> dict:
    serve_args = ["--max-num-seqs", str(args.concurrency), "--disable-log-stats"]
    results = {}
    for name, launcher in (("IncrementalDetokenizer", _PYTHON_PATH_LAUNCHER),
                           ("FastIncrementalDetokenizer", _FAST_PATH_LAUNCHER)):
        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        server = Server(launcher, serve_args, env)
        try:
            asyncio.run(_round(server.url, args.concurrency, args.concurrency, 16))  # warm-up
            per_token, tokens_per_s = [], []
            for _ in range(args.repeat):
                before, started = server.cpu_seconds(), time.perf_counter()
                tokens = asyncio.run(_round(server.url, args.requests, args.concurrency,
                                            args.max_tokens, args.stream))
                per_token.append((server.cpu_seconds() - before) / tokens * 1e6)
                tokens_per_s.append(tokens / (time.perf_counter() - started))
        finally:
            server.close()
        # Throughput matters when reading per-token CPU: time-proportional work of the API
        # process (timers, polling) is spread over fewer tokens when the engine is slow.
        results[name] = {"api_cpu_us_per_token_median": statistics.median(per_token),
                         "runs": per_token, "tokens_per_s": tokens_per_s}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    micro_parser = commands.add_parser("micro")
    micro_parser.add_argument("--sequences", type=int, default=32)
    micro_parser.add_argument("--tokens", type=int, default=256)
    micro_parser.add_argument("--repeat", type=int, default=5)
    serve_parser = commands.add_parser("serve")
    serve_parser.add_argument("--concurrency", type=int, default=32)
    serve_parser.add_argument("--requests", type=int, default=64)
    serve_parser.add_argument("--max-tokens", type=int, default=128)
    serve_parser.add_argument("--repeat", type=int, default=3)
    serve_parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                              help="--no-stream: whole responses, so the API process does no "
                                   "per-token SSE work and detokenization weighs more")
    serve_parser.add_argument("--threads", type=int, default=None,
                              help="OMP_NUM_THREADS of the server's workers; 1 on a shared "
                                   "machine, where two threads spin-wait for each other")
    args = parser.parse_args()
    print(json.dumps(micro(args) if args.command == "micro" else serve(args), indent=2))


if __name__ == "__main__":
    main()
