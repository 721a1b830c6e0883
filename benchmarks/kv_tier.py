"""The KV offload tier (--kv-offload-size): time to first token on the late turns of
multi-turn conversations whose histories outgrow the KV cache, with and without the
tier; and a batch whose requests are preempted (swap from the tier instead of
recompute).

    python benchmarks/kv_tier.py [--model DIR] [--rounds 3] [--conversations 4]
                                 [--turns 6] [--user-tokens 256] [--answer-tokens 16]
    python benchmarks/kv_tier.py --swap [--requests 4] [--prompt 256] [--output 512]

Turns: ``--conversations`` conversations, served round-robin a turn at a time (turn 1
of each, then turn 2 of each, ...), one request at a time; each turn's prompt is the
conversation so far (its earlier prompts and the model's greedy answers) plus
``--user-tokens`` new random tokens, answered with ``--answer-tokens``. The KV cache
holds a little more than one conversation's longest history, so by a conversation's
next turn the others have evicted its blocks: without the tier it computes its whole
history again, with it the history comes back from the tier's file. Two engines in one
process on the same checkpoint and cache size, one with a 1 GiB tier (in a temporary
directory), run the same conversations (new random tokens each round), in alternating
order round by round, so a busy host slows both alike. TTFT is the request's first-token
time less its arrival, as the offline engine records them.

Swap: ``--requests`` prompts of ``--prompt`` tokens decode ``--output`` tokens each, at
once, in a KV cache that holds all the prompts but about half of the finished
sequences: as they grow, the newest are preempted; without the tier each resume
computes its prompt and output so far again, with it its full blocks come back from the
tier. Wall time of the batch, preemptions, tier loads.

Writes benchmarks/results/kv_tier[_swap]-<model name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time

from loom import LLM, SamplingParams

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_MODEL = "/work/bench-envs/models/llama-1b-random"
BLOCK_SIZE = 16
TIER_BYTES = 1 << 30


def make_engines(args: argparse.Namespace, max_model_len: int, num_blocks: int,
                 tier_dir: str) -> dict[str, LLM]:
    common = dict(max_model_len=max_model_len, num_gpu_blocks_override=num_blocks,
                  block_size=BLOCK_SIZE, max_num_batched_tokens=args.budget)
    return {"no tier": LLM(args.model, **common),
            "tier": LLM(args.model, kv_offload_size=TIER_BYTES, kv_offload_path=tier_dir,
                        **common)}


def tier_stats(llm: LLM) -> dict:
    tier = llm.engine.engine_core.scheduler.kv_cache.tier
    return {} if tier is None else dict(vars(tier.stats))


def run_conversations(llm: LLM, rounds_tokens: list[list[list[int]]], answer_tokens: int
                      ) -> list[dict]:
    """Serve one round's conversations (turn by turn, round-robin); each turn's record."""
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    histories = [[] for _ in rounds_tokens]
    records = []
    for turn in range(len(rounds_tokens[0])):
        for conversation, turns in enumerate(rounds_tokens):
            prompt = histories[conversation] + turns[turn]
            output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            histories[conversation] = prompt + list(output.outputs[0].token_ids)
            records.append(dict(turn=turn + 1, conversation=conversation,
                                prompt_tokens=len(prompt),
                                cached_tokens=output.num_cached_tokens,
                                ttft_s=output.metrics["first_token_time"]
                                - output.metrics["arrival_time"],
                                tokens=list(output.outputs[0].token_ids)))
    return records


def measure_turns(args: argparse.Namespace) -> dict:
    history = args.turns * (args.user_tokens + args.answer_tokens)
    max_model_len = -(-(history + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE
    # a little more than one conversation's longest history
    num_blocks = max_model_len // BLOCK_SIZE + 8
    rng = random.Random(0)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    with tempfile.TemporaryDirectory() as tier_dir:
        engines = make_engines(args, max_model_len, num_blocks, tier_dir)
        runs: dict[str, list[list[dict]]] = {name: [] for name in engines}
        for round_index in range(args.rounds):
            tokens = [[[rng.randrange(100, vocab - 100) for _ in range(args.user_tokens)]
                       for _ in range(args.turns)] for _ in range(args.conversations)]
            order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
            for name in order:
                started = time.perf_counter()
                records = run_conversations(engines[name], tokens, args.answer_tokens)
                runs[name].append(records)
                late = [r["ttft_s"] for r in records if r["turn"] >= args.turns - 1]
                print(f"round {round_index + 1} {name:8s}: {time.perf_counter() - started:6.1f} s, "
                      f"late-turn TTFT median {statistics.median(late):.3f} s", flush=True)
        stats = {name: tier_stats(llm) for name, llm in engines.items()}
        for llm in engines.values():
            llm.shutdown()
    summary = {}
    for name, rounds in runs.items():
        by_turn = {}
        for turn in range(1, args.turns + 1):
            ttfts = [r["ttft_s"] for records in rounds for r in records if r["turn"] == turn]
            cached = [r["cached_tokens"] for records in rounds for r in records
                      if r["turn"] == turn]
            prompt = [r["prompt_tokens"] for records in rounds for r in records
                      if r["turn"] == turn]
            by_turn[turn] = dict(ttft_median_s=round(statistics.median(ttfts), 4),
                                 ttft_all_s=[round(t, 4) for t in ttfts],
                                 prompt_tokens_mean=round(statistics.mean(prompt), 1),
                                 cached_tokens_mean=round(statistics.mean(cached), 1))
        late = [r["ttft_s"] for records in rounds for r in records if r["turn"] >= args.turns - 1]
        summary[name] = dict(by_turn=by_turn, late_turns_ttft_median_s=round(
            statistics.median(late), 4), tier=stats[name])
    same = sum(a["tokens"] == b["tokens"] for ra, rb in zip(runs["tier"], runs["no tier"])
               for a, b in zip(ra, rb))
    total = sum(len(records) for records in runs["tier"])
    return dict(kind="turns", model=args.model, rounds=args.rounds,
                conversations=args.conversations, turns=args.turns,
                user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                max_model_len=max_model_len, kv_cache_blocks=num_blocks,
                block_size=BLOCK_SIZE, tier_bytes=TIER_BYTES,
                late_turns_ttft_ratio=round(summary["no tier"]["late_turns_ttft_median_s"]
                                            / summary["tier"]["late_turns_ttft_median_s"], 2),
                answers_equal=f"{same} of {total}", engines=summary)


def measure_swap(args: argparse.Namespace) -> dict:
    max_model_len = -(-(args.prompt + args.output + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE
    per_request = max_model_len // BLOCK_SIZE
    num_blocks = max(per_request, args.requests * per_request // 2)
    rng = random.Random(1)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tier_dir:
        engines = make_engines(args, max_model_len, num_blocks, tier_dir)
        for round_index in range(args.rounds):
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt)]
                       for _ in range(args.requests)]
            order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
            for name in order:
                llm = engines[name]
                core = llm.engine.engine_core
                preemptions = core.scheduler.num_preemptions
                started = time.perf_counter()
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                       use_tqdm=False)
                seconds = time.perf_counter() - started
                record = dict(seconds=round(seconds, 2),
                              preemptions=core.scheduler.num_preemptions - preemptions,
                              tokens=[list(o.outputs[0].token_ids) for o in outputs])
                results.setdefault(name, []).append(record)
                print(f"round {round_index + 1} {name:8s}: {seconds:6.1f} s, "
                      f"{record['preemptions']} preemptions", flush=True)
        stats = {name: tier_stats(llm) for name, llm in engines.items()}
        for llm in engines.values():
            llm.shutdown()
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(results["tier"], results["no tier"]))
    summary = {name: dict(seconds=[r["seconds"] for r in records],
                          seconds_median=statistics.median(r["seconds"] for r in records),
                          preemptions=[r["preemptions"] for r in records], tier=stats[name])
               for name, records in results.items()}
    return dict(kind="swap", model=args.model, rounds=args.rounds, requests=args.requests,
                prompt=args.prompt, output=args.output, max_model_len=max_model_len,
                kv_cache_blocks=num_blocks, block_size=BLOCK_SIZE,
                ratio=round(summary["no tier"]["seconds_median"]
                            / summary["tier"]["seconds_median"], 2),
                rounds_with_equal_tokens=f"{same} of {args.rounds}", engines=summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--swap", action="store_true", help="the preemption batch instead")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=512)
    args = parser.parse_args()
    result = measure_swap(args) if args.swap else measure_turns(args)
    result.update(host=platform.processor() or platform.machine(), cores=os.cpu_count(),
                  load_average=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M"))
    name = os.path.basename(args.model.rstrip("/"))
    path = os.path.join(RESULTS, f"kv_tier{'_swap' if args.swap else ''}-{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    keys = ("late_turns_ttft_ratio", "answers_equal") if not args.swap else (
        "ratio", "rounds_with_equal_tokens")
    print(json.dumps({key: result[key] for key in keys}), "->", path)


if __name__ == "__main__":
    main()
