"""``loom bench serve``: load any OpenAI-compatible server and measure it as vLLM does.

    loom bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --random-input-len 128 --random-output-len 128 --max-concurrency 8 \\
        --tokenizer default --goodput ttft:500 tpot:50 --result-file out.json

Each request streams (``stream: true`` with ``stream_options.include_usage``) and asks
for a fixed output length: ``max_tokens`` plus ``ignore_eos: true`` (understood by loom,
vLLM and llama-server). Requests leave on a gamma/Poisson schedule (``arrivals.py``),
at most ``--max-concurrency`` at a time; the metrics are ``metrics.py``'s.

With speculative decoding, the server's ``/metrics`` counters (loom's and vLLM's
``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``), read before and after
the run, give the acceptance rate and length (``metrics.py``).

Output token counts come from the server's ``usage`` when it reports one, otherwise
from re-tokenizing the text (with ``--tokenizer``), otherwise from the chunks with text.
TTFT ends at the first chunk carrying ``choices`` (vLLM's rule, so a chat stream's
role-only first chunk counts); after it, chunks without text (llama-server's closing
``finish_reason`` chunk, for one) are neither an inter-token gap nor part of latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from typing import Any

import httpx
from tqdm.auto import tqdm

from loom.bench.arrivals import arrival_times
from loom.bench.datasets import SampleRequest, TokenizerLike, make_requests, random_requests
from loom.bench.metrics import (SPEC_DECODE_COUNTERS, RequestResult, compute_metrics,
                                format_table, parse_goodput, spec_decode_metrics)

_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)")  # name{labels} value


def load_bench_tokenizer(name: str | None) -> TokenizerLike | None:
    if name is None:
        return None
    from loom.tokenizer import load_tokenizer

    if name == "default":
        from loom.default_model import default_model_path

        name = default_model_path()
    return load_tokenizer(name)


class OpenAIStreamClient:
    """Sends one streaming request and times its chunks."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, endpoint: str,
                 temperature: float, ignore_eos: bool, tokenizer: TokenizerLike | None) -> None:
        self.client = client
        self.url = url
        self.model = model
        self.chat = endpoint.endswith("/chat/completions")
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.tokenizer = tokenizer

    def body(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": request.output_len,
            "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = [{"role": "user",
                                 "content": request.chat_message or request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: SampleRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        text_parts: list[str] = []
        num_chunks = 0
        usage: dict[str, Any] | None = None
        start = time.perf_counter()
        last = start
        try:
            async with self.client.stream("POST", self.url, json=self.body(request)) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    result.error = f"HTTP {response.status_code}: {detail}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = time.perf_counter()
                    data = json.loads(payload)
                    if data.get("error"):
                        error = data["error"]
                        result.error = "error event in the stream: " + str(
                            error.get("message", error) if isinstance(error, dict) else error)
                        return result
                    if data.get("usage"):
                        usage = data["usage"]
                    choices = data.get("choices")
                    if not choices:
                        continue
                    choice = choices[0]
                    piece = (choice.get("delta") or {}).get("content") if self.chat \
                        else choice.get("text")
                    if num_chunks == 0:
                        result.ttft = now - start
                    elif not piece:
                        # No text after the first chunk (llama-server's closing chunk with
                        # finish_reason, a held-back partial character): not a token gap.
                        continue
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
                    if piece:
                        text_parts.append(piece)
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            result.error = f"{type(error).__name__}: {error}"
            return result
        if num_chunks == 0:
            result.error = "the stream ended without a chunk carrying choices"
            return result
        result.latency = last - start
        result.generated_text = "".join(text_parts)
        result.output_len = self._count_output(usage, result.generated_text, len(text_parts))
        if usage and usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
        result.success = True
        return result

    def _count_output(self, usage: dict[str, Any] | None, text: str, num_text_chunks: int) -> int:
        if usage and usage.get("completion_tokens") is not None:
            return int(usage["completion_tokens"])
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return num_text_chunks


async def _spec_decode_counters(client: httpx.AsyncClient,
                                base_url: str) -> tuple[float, ...] | None:
    """``SPEC_DECODE_COUNTERS`` from the server's Prometheus ``/metrics`` (summed over
    labels), or None when it has no such counters."""
    try:
        response = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    names = {f"vllm:spec_decode_{name}_total": i for i, name in enumerate(SPEC_DECODE_COUNTERS)}
    totals = [0.0] * len(names)
    found = False
    for line in response.text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match and match.group(1) in names:
            totals[names[match.group(1)]] += float(match.group(2))
            found = True
    return tuple(totals) if found else None


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest],
                        tokenizer: TokenizerLike | None) -> dict[str, Any]:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        try:
            model = args.model or await _first_model(client, base_url)
        except httpx.HTTPError as error:
            raise ValueError(f"cannot list models at {base_url}/v1/models ({error}); is the "
                             "server up? check --base-url") from None
        sender = OpenAIStreamClient(client, base_url + args.endpoint, model, args.endpoint,
                                    args.temperature, args.ignore_eos, tokenizer)
        # Warm-up prompts of their own: reusing measured ones would give those a
        # prefix-cache hit (llama-server, loom and vLLM all keep one).
        for warm in random_requests(args.num_warmups, 16, 4, tokenizer=tokenizer,
                                    seed=args.seed + 1_000_003):
            result = await sender.send(warm)
            if not result.success:
                raise ValueError(f"warm-up request to {sender.url} failed: {result.error}; "
                                 "check --base-url, --endpoint and --model")

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        progress = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests",
                        dynamic_ncols=True)

        async def one(request: SampleRequest) -> RequestResult:
            if semaphore is None:
                result = await sender.send(request)
            else:
                async with semaphore:
                    result = await sender.send(request)
            progress.update(1)
            return result

        spec_before = await _spec_decode_counters(client, base_url)
        send_at = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        start = time.perf_counter()
        tasks = []
        for request, at in zip(requests, send_at):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        spec_after = await _spec_decode_counters(client, base_url)

    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    metrics = compute_metrics(results, duration, parse_goodput(args.goodput), percentiles)
    wrong_length = sum(1 for r, q in zip(results, requests)
                       if r.success and r.output_len != q.output_len)
    record: dict[str, Any] = {
        "label": args.label, "backend": "openai", "base_url": base_url,
        "endpoint": args.endpoint, "model": model, "dataset_name": args.dataset_name,
        "num_prompts": len(requests), "request_rate": args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos, "requests_with_other_output_len": wrong_length,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **metrics,
    }
    if spec_before is not None and spec_after is not None:
        record.update(spec_decode_metrics(spec_before, spec_after))
    if args.save_detailed:
        record["input_lens"] = [r.prompt_len for r in results]
        record["output_lens"] = [r.output_len for r in results]
        record["ttfts"] = [r.ttft for r in results]
        record["itls"] = [r.itl for r in results]
        record["errors"] = [r.error for r in results]
    return record


def main(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    parse_goodput(args.goodput)  # fail on a bad SLO before sending anything
    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = make_requests(args, tokenizer)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print(f"loom bench serve: {len(requests)} {args.dataset_name} requests to "
          f"{args.base_url}{args.endpoint}, rate {rate}, burstiness {args.burstiness:g}, "
          f"max concurrency {args.max_concurrency or 'unlimited'}", flush=True)
    record = asyncio.run(run_benchmark(args, requests, tokenizer))
    print(format_table(record))
    if record["requests_with_other_output_len"] and args.ignore_eos:
        print(f"note: {record['requests_with_other_output_len']} requests returned another "
              "number of tokens than max_tokens; does the server honour ignore_eos?",
              file=sys.stderr)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)
    return 1 if record["failed"] else 0
