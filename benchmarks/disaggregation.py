"""Prefill/decode disaggregation: KV transfer throughput, and serving latency
disaggregated vs mixed (benchmarks/disaggregation.md, docs/disaggregation.md).

``transfer``: the workers' half of the connector (loom/worker/kv_connector.py), the same
code a server runs, without a model: a prefill rank's cache and a decode rank's cache
(the default model's geometry unless told: 30 layers, 3 KV heads of 64, bf16, 22.5 KiB a
token) in two processes, holds registered and pulls issued as the schedulers would, each
transfer timed from the pull's start to the decode rank's recv_done report. Both
transports, prompt lengths in tokens; prints ms per request and GB/s.

    python benchmarks/disaggregation.py transfer --tokens 128 512 2048 8192 --repeat 5

``recompute``: what the decode instance pays for computing the last prompt position
itself (docs/disaggregation.md: why): a prefill and a decode engine core in this process
(the default model unless ``--model``), one request at a time; per prompt length, the
decode instance's step that computes that position and samples the first token,
against its next decode steps (before, the first token came with the blocks, and the
request's first step was such a decode step).

    python benchmarks/disaggregation.py recompute --tokens 128 512 2048 --repeat 5

``serve``: real ``loom serve`` processes on the default model (or ``--model``), all
started at once: one mixed server, and a prefill and a decode server behind a
``loom router --prefill --decode`` (``--hops client``: the client makes the router's two
hops itself). Closed-loop clients, each sending a mix of long prompts
(``--long-tokens``, ``--long-output`` tokens out) and short chats; TTFT and TPOT per
class. The modes are interleaved: for each repeat and concurrency, one mode then the
other (the order alternating), so a change in the host's load hits both alike; a pair
of runs that would end past ``--budget-s`` (from the start, start-up included) is not
started. Prints each run, then the median over
repeats of each (mode, clients).

    python benchmarks/disaggregation.py serve --clients 8 32 --requests-per-client 2 \
        --repeats 2 --budget-s 420
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


# ----------------------------------------------------------------- recompute


def recompute(args: argparse.Namespace) -> list[dict]:
    from loom.engine_args import make_engine_config
    from loom.core.engine_core import EngineCore
    from loom.default_model import default_model_path
    from loom.request import Request
    from loom.sampling_params import SamplingParams

    model = args.model or default_model_path()
    cores = {role: EngineCore.from_config(make_engine_config(
        model, max_model_len=max(args.tokens) + 64, splitwise_role=role,
        kv_transfer_config={"kv_transport": "shm"})) for role in ("prefill", "decode")}
    prefill, decode = cores["prefill"], cores["decode"]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    rows = []
    try:
        for num_tokens in args.tokens:
            first_ms, next_ms = [], []
            for r in range(args.repeat + 1):  # the first one warms up
                prompt = [(r * 7919 + i * 31) % 20000 + 100 for i in range(num_tokens)]
                request_id = f"{num_tokens}-{r}"
                prefill.add_request(Request(request_id, prompt, params.clone(
                    kv_transfer_params={"do_remote_decode": True})))
                handoff = None
                while handoff is None:
                    handoff = next((o.kv_transfer_params for o in prefill.step()
                                    if o.kv_transfer_params), None)
                decode.add_request(Request(request_id, prompt, params.clone(
                    kv_transfer_params=handoff)))
                step_ms = []  # each step that produced a token
                while decode.has_unfinished_requests():
                    if decode.scheduler.only_loading:
                        decode.poll_kv_transfers(0.001)  # pulling: nothing to compute
                    started = time.perf_counter()
                    outputs = decode.step()
                    if any(o.new_token_ids for o in outputs):
                        step_ms.append((time.perf_counter() - started) * 1e3)
                while prefill.scheduler.kv_transfer.num_held_blocks:
                    prefill.poll_kv_transfers(0.01)
                if r:
                    first_ms.append(step_ms[0])
                    next_ms += step_ms[1:]
            row = {"tokens": num_tokens, "first_token_step_ms": statistics.median(first_ms),
                   "decode_step_ms": statistics.median(next_ms)}
            rows.append(row)
            print(f"{num_tokens:6} prompt tokens: the step computing the last prompt position "
                  f"{row['first_token_step_ms']:7.2f} ms, a decode step after it "
                  f"{row['decode_step_ms']:7.2f} ms (medians of {args.repeat})", flush=True)
    finally:
        for core in cores.values():
            core.shutdown()
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
        if response.status_code != 200:
            raise RuntimeError(f"{target}: {response.status_code} {await response.aread()!r}")
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
            "ttft_ms_p90": _p90(ttft) * 1e3 if ttft else None,
            "tpot_ms_median": statistics.median(tpot) * 1e3 if tpot else None,
            "tpot_ms_p90": _p90(tpot) * 1e3 if tpot else None}
    return summary


def _p90(values: list[float]) -> float:
    """The smallest value at least 90% of ``values`` (sorted) do not exceed."""
    return values[min(len(values) - 1, -(-9 * len(values) // 10) - 1)]


def _prompts(args) -> dict[str, list[str]]:
    words = ("river stone light garden window morning paper silver music engine harbor "
             "forest quiet bridge letter candle").split()
    long_words = max(8, int(args.long_tokens / 1.3))
    long = [" ".join(words[(i * 3 + k) % len(words)] for k in range(long_words))
            for i in range(8)]
    short = [f"Tell me about the {w} in {words[(i + 5) % len(words)]} {i}."
             for i, w in enumerate(words)]
    return {"long": long, "short": short}


def _start_servers(args) -> tuple[list, dict]:
    """Every server the modes need, started side by side; (processes, urls)."""
    from concurrent.futures import ThreadPoolExecutor

    from loom_server import LoomServer

    model_args = [args.model] if args.model else [None]
    common = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory",
              args.kv_cache_memory, *args.server_args]
    flags = {}
    if "mixed" in args.modes:
        flags["mixed"] = [*common, *args.mixed_server_args]
    if "disaggregated" in args.modes:
        for role in ("prefill", "decode"):
            flags[role] = [*common, *args.disaggregated_server_args, "--splitwise-role", role,
                           "--kv-transfer-config", json.dumps({"kv_transport": args.transport})]
    with ThreadPoolExecutor(len(flags)) as pool:
        futures = {name: pool.submit(LoomServer, *model_args, *f, startup_timeout=900)
                   for name, f in flags.items()}
        servers = {}
        errors = []
        for name, future in futures.items():
            try:
                servers[name] = future.result()
            except Exception as error:  # noqa: BLE001 — close the others, then fail
                errors.append(f"{name}: {error}")
    processes = list(servers.values())
    if errors:
        for server in processes:
            server.close()
        raise RuntimeError("; ".join(errors))
    urls = {name: server.url for name, server in servers.items()}
    if "disaggregated" in args.modes and args.hops == "router":
        from test_router import RouterProcess

        router = RouterProcess(args=("--prefill", urls["prefill"], "--decode", urls["decode"]))
        processes.append(router)
        router.wait_for_health(lambda body: body["status"] == "ok")
        urls["router"] = router.url
    return processes, urls


def serve(args: argparse.Namespace) -> list[dict]:
    prompts = _prompts(args)
    started = time.monotonic()  # --budget-s counts the start-up too
    processes, urls = _start_servers(args)
    rows = []
    try:
        targets = {"mixed": {"mixed": urls.get("mixed")},
                   "disaggregated": {k: v for k, v in urls.items() if k != "mixed"}}
        for mode in args.modes:  # one warm request of each kind first
            asyncio.run(_load(targets[mode], mode != "mixed", 1, 2, prompts,
                              argparse.Namespace(**{**vars(args), "long_every": 2})))
        pair_s: dict[int, float] = {}  # how long the last pair of runs at this many clients took
        for repeat in range(args.repeats):
            for i, clients in enumerate(args.clients):
                elapsed = time.monotonic() - started
                if elapsed + pair_s.get(clients, 0.0) > args.budget_s:
                    print(f"# repeat {repeat}, {clients} clients not run: {elapsed:.0f} s "
                          f"spent of --budget-s {args.budget_s:.0f}", flush=True)
                    continue
                pair_started = time.monotonic()
                order = args.modes if (repeat + i) % 2 == 0 else args.modes[::-1]
                for mode in order:
                    summary = asyncio.run(_load(targets[mode], mode != "mixed", clients,
                                                args.requests_per_client, prompts, args))
                    summary["mode"] = (mode if mode == "mixed"
                                       else f"disaggregated ({args.transport}, {args.hops})")
                    summary["repeat"] = repeat
                    rows.append(summary)
                    print(json.dumps(summary), flush=True)
                pair_s[clients] = time.monotonic() - pair_started
    finally:
        for process in processes:
            process.close()
    print(f"# {time.monotonic() - started:.0f} s in all; medians over repeats:")
    for key in sorted({(row["mode"], row["clients"]) for row in rows}):
        runs = [row for row in rows if (row["mode"], row["clients"]) == key]
        cells = []
        for kind in ("long", "short"):
            for stat, label in (("ttft_ms_median", "TTFT med"), ("ttft_ms_p90", "p90"),
                                ("tpot_ms_median", "TPOT med"), ("tpot_ms_p90", "p90")):
                values = [run[kind][stat] for run in runs if run[kind][stat] is not None]
                cells.append(f"{kind} {label} {statistics.median(values):,.0f}" if values
                             else f"{kind} {label} -")
        print(f"{key[0]:28} {key[1]:3} clients, {len(runs)} runs (ms): " + ", ".join(cells),
              flush=True)
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
    c = sub.add_parser("recompute")
    c.add_argument("--model", default=None, help="default: loom's default model")
    c.add_argument("--tokens", nargs="+", type=int, default=[128, 512, 2048])
    c.add_argument("--repeat", type=int, default=5)
    c.add_argument("--decode-steps", type=int, default=8)
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
    s.add_argument("--hops", choices=["router", "client"], default="router",
                   help="disaggregated requests through a loom router started here, or "
                        "the client making its two hops itself")
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--budget-s", type=float, default=420.0,
                   help="start no pair of runs that the last pair at its concurrency says "
                        "would end past this many seconds from the start (start-up included)")
    s.add_argument("--server-args", nargs="*", default=[], help="flags for every server")
    s.add_argument("--mixed-server-args", nargs="*", default=[])
    s.add_argument("--disaggregated-server-args", nargs="*", default=[],
                   help="e.g. --cpu-threads-per-rank 1: the two instances split the cores "
                        "the mixed one has alone")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    rows = {"transfer": transfer, "recompute": recompute, "serve": serve}[args.command](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
