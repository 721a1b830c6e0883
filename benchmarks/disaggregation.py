"""Prefill/decode disaggregation: KV transfer throughput, and serving latency
disaggregated vs mixed (benchmarks/disaggregation.md, docs/disaggregation.md).

``transfer``: the workers' half of the connector (loom/worker/kv_connector.py), the same
code a server runs, without a model: a prefill rank's cache and a decode rank's cache
(the default model's geometry unless told: 30 layers, 3 KV heads of 64, bf16, 22.5 KiB a
token) in two processes, holds registered and pulls issued as the schedulers would, each
transfer timed from the pull's start to the decode rank's recv_done report. Both
transports, prompt lengths in tokens; prints ms per request and GB/s.

    python benchmarks/disaggregation.py transfer --tokens 128 512 2048 8192 --repeat 5

``serve``: real ``loom serve`` processes on the default model (or ``--model``): one mixed
server, or a prefill and a decode server (the client does what ``loom router`` does:
the request to the prefill server with do_remote_decode, then to the decode server,
streamed). Closed-loop clients, each sending a mix of long prompts (``--long-tokens``,
``--long-output`` tokens out) and short chats; TTFT and TPOT per class at each
concurrency; ``--router URL`` sends the disaggregated load through a running router.

    python benchmarks/disaggregation.py serve --clients 8 32 --requests-per-client 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "entrypoints")]

# ----------------------------------------------------------------- transfer


def _prefill_rank(transport: str, shape, ready, done, block_lists) -> None:
    """A prefill rank's connector half on its own cache; serves what it is told."""
    import torch

    from loom.config import KVTransferConfig
    from loom.core.wire import KVConnectorMetadata, KVHold
    from loom.ipc.kv_events import KVEventReceiver
    from loom.worker.kv_connector import KVConnectorWorker
    from loom.worker.kv_transport import SharedKVSegment

    segment = SharedKVSegment.create(shape, torch.bfloat16, 0) if transport == "shm" else None
    storage = segment.tensor if segment else torch.empty(shape, dtype=torch.bfloat16)
    storage.normal_()
    events = KVEventReceiver("127.0.0.1")
    worker = KVConnectorWorker(KVTransferConfig(kv_role="kv_producer", kv_transport=transport),
                               0, 1, storage, events.address,
                               segment.name if segment else None)
    worker.after_step(KVConnectorMetadata(holds=[
        KVHold(f"t{i}", ids) for i, ids in enumerate(block_lists)]))
    ready.put((worker.address, float(storage[0, 0, 0, block_lists[0][0]].sum())))
    done.get()
    worker.close()
    events.close()


def transfer(args: argparse.Namespace) -> list[dict]:
    import torch

    from loom.config import KVTransferConfig
    from loom.core.wire import KVConnectorMetadata, KVLoad
    from loom.ipc.kv_events import KVEventReceiver
    from loom.worker.kv_connector import KVConnectorWorker
    from loom.worker.kv_transport import KVLayout

    block_size = 16
    rows = []
    for transport in args.transports:
        for num_tokens in args.tokens:
            num_blocks = -(-num_tokens // block_size)
            # Each repeat pulls other blocks (as requests do), scattered on the prefill side.
            total = num_blocks * args.repeat
            shape = (args.layers, 2, args.kv_heads, total + 1, block_size, args.head_dim)
            stride = [(i * 7919) % total for i in range(total)]  # a permutation: scattered
            block_lists = [stride[r * num_blocks:(r + 1) * num_blocks] for r in range(args.repeat)]
            context = multiprocessing.get_context("spawn")
            ready, done = context.Queue(), context.Queue()
            prefill = context.Process(target=_prefill_rank,
                                      args=(transport, shape, ready, done, block_lists))
            prefill.start()
            address, _ = ready.get(timeout=120)
            storage = torch.zeros(shape, dtype=torch.bfloat16)
            storage.view(torch.uint8).fill_(1)  # touched: no page faults in the timing
            events = KVEventReceiver("127.0.0.1")
            worker = KVConnectorWorker(KVTransferConfig(kv_role="kv_consumer",
                                                        kv_transport=transport),
                                       0, 1, storage, events.address)
            times = []
            for r, remote in enumerate(block_lists):
                local = list(range(r * num_blocks, (r + 1) * num_blocks))  # fresh, in a run
                started = time.perf_counter()
                worker.after_step(KVConnectorMetadata(loads=[
                    KVLoad(f"t{r}", [address], remote, local)]))
                (event,) = events.poll(60_000)
                times.append(time.perf_counter() - started)
                assert event.kind == "recv_done", event
            worker.close()
            events.close()
            done.put(None)
            prefill.join(30)
            nbytes = num_blocks * KVLayout.of(storage).bytes_per_block
            median = statistics.median(times)
            rows.append({"transport": transport, "tokens": num_tokens, "blocks": num_blocks,
                         "MB": nbytes / 1e6, "ms_median": median * 1e3,
                         "ms_min": min(times) * 1e3, "GB_per_s": nbytes / median / 1e9})
            print(f"{transport:4} {num_tokens:6} tokens {nbytes / 1e6:8.1f} MB  "
                  f"{median * 1e3:8.2f} ms (min {min(times) * 1e3:7.2f})  "
                  f"{nbytes / median / 1e9:6.2f} GB/s", flush=True)
    return rows


# ----------------------------------------------------------------- serve


async def _one_request(client, urls: dict, body: dict, disaggregated: bool) -> dict:
    """Stream one completion; TTFT from the client's send to the first text, TPOT over
    the rest. Disaggregated without a router: the prefill hop first, as loom router."""
    started = time.perf_counter()
    if disaggregated and "router" not in urls:
        answer = await client.post(f"{urls['prefill']}/v1/completions", json={
            **body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}})
        answer.raise_for_status()
        body = {**body, "kv_transfer_params": answer.json()["kv_transfer_params"]}
        target = urls["decode"]
    else:
        target = urls.get("router", urls.get("mixed"))
    first = None
    num_tokens = 0
    async with client.stream("POST", f"{target}/v1/completions",
                             json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event["choices"]:
                if choice["text"] or choice["finish_reason"]:
                    num_tokens += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": first - started,
            "tpot": (end - first) / max(num_tokens - 1, 1) if num_tokens > 1 else None}


async def _load(urls: dict, disaggregated: bool, clients: int, per_client: int,
                prompts: dict, args) -> dict:
    import httpx

    results: dict[str, list] = {"long": [], "short": []}
    limits = httpx.Limits(max_connections=2 * clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one_client(index: int):
            for j in range(per_client):
                kind = "long" if (index + j) % args.long_every == 0 else "short"
                body = {"prompt": prompts[kind][(index * per_client + j) % len(prompts[kind])],
                        "max_tokens": args.long_output if kind == "long" else args.short_output,
                        "temperature": 0.0, "ignore_eos": True}
                results[kind].append(await _one_request(client, urls, body, disaggregated))

        started = time.perf_counter()
        await asyncio.gather(*(one_client(i) for i in range(clients)))
        wall = time.perf_counter() - started
    summary = {"clients": clients, "wall_s": wall}
    for kind, rows in results.items():
        ttft = sorted(r["ttft"] for r in rows)
        tpot = sorted(r["tpot"] for r in rows if r["tpot"] is not None)
        summary[kind] = {
            "n": len(rows),
            "ttft_ms_median": statistics.median(ttft) * 1e3 if ttft else None,
            "ttft_ms_p90": ttft[int(0.9 * (len(ttft) - 1))] * 1e3 if ttft else None,
            "tpot_ms_median": statistics.median(tpot) * 1e3 if tpot else None,
            "tpot_ms_p90": tpot[int(0.9 * (len(tpot) - 1))] * 1e3 if tpot else None}
    return summary


def _prompts(args) -> dict[str, list[str]]:
    words = ("river stone light garden window morning paper silver music engine harbor "
             "forest quiet bridge letter candle").split()
    long_words = max(8, int(args.long_tokens / 1.3))
    long = [" ".join(words[(i * 3 + k) % len(words)] for k in range(long_words))
            for i in range(8)]
    short = [f"Tell me about the {w} in {words[(i + 5) % len(words)]} {i}."
             for i, w in enumerate(words)]
    return {"long": long, "short": short}


def serve(args: argparse.Namespace) -> list[dict]:
    from loom_server import LoomServer

    model_args = [args.model] if args.model else []
    common = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
              *args.server_args]
    prompts = _prompts(args)
    rows = []
    for mode in args.modes:
        servers = []
        try:
            if mode == "mixed":
                servers.append(LoomServer(*(model_args or [None]), *common,
                                          *args.mixed_server_args, startup_timeout=900))
                urls = {"mixed": servers[0].url}
            else:
                for role in ("prefill", "decode"):
                    servers.append(LoomServer(*(model_args or [None]), *common,
                                              *args.disaggregated_server_args,
                                              "--splitwise-role", role, "--kv-transfer-config",
                                              json.dumps({"kv_transport": args.transport}),
                                              startup_timeout=900))
                urls = {"prefill": servers[0].url, "decode": servers[1].url}
                if args.router:
                    urls["router"] = args.router
            # One warm request of each kind first.
            asyncio.run(_load(urls, mode != "mixed", 1, 2, prompts,
                              argparse.Namespace(**{**vars(args), "long_every": 2})))
            for clients in args.clients:
                summary = asyncio.run(_load(urls, mode != "mixed", clients,
                                            args.requests_per_client, prompts, args))
                summary["mode"] = mode if mode == "mixed" else f"disaggregated ({args.transport})"
                rows.append(summary)
                print(json.dumps(summary), flush=True)
        finally:
            for server in servers:
                server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transfer")
    t.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    t.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 2048, 8192])
    t.add_argument("--repeat", type=int, default=5)
    t.add_argument("--layers", type=int, default=30)
    t.add_argument("--kv-heads", type=int, default=3)
    t.add_argument("--head-dim", type=int, default=64)
    s = sub.add_parser("serve")
    s.add_argument("--model", default=None, help="default: loom's default model")
    s.add_argument("--modes", nargs="+", default=["mixed", "disaggregated"])
    s.add_argument("--transport", default="shm")
    s.add_argument("--clients", nargs="+", type=int, default=[8, 32])
    s.add_argument("--requests-per-client", type=int, default=4)
    s.add_argument("--long-every", type=int, default=4, help="every n-th request is long")
    s.add_argument("--long-tokens", type=int, default=1500)
    s.add_argument("--long-output", type=int, default=8)
    s.add_argument("--short-output", type=int, default=32)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--kv-cache-memory", default="1GiB")
    s.add_argument("--router", default=None, help="a running loom router for the "
                   "disaggregated mode (its --prefill/--decode must be these servers)")
    s.add_argument("--server-args", nargs="*", default=[], help="flags for every server")
    s.add_argument("--mixed-server-args", nargs="*", default=[])
    s.add_argument("--disaggregated-server-args", nargs="*", default=[],
                   help="e.g. --cpu-threads-per-rank 1: the two instances split the cores "
                        "the mixed one has alone")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    rows = transfer(args) if args.command == "transfer" else serve(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
