"""Expert parallel across data-parallel replicas (DP=2 x EP=2, all-to-all) against tensor
parallel with expert parallel (TP=2, EP=2, all-reduce), on the same random MoE checkpoint
(benchmarks/dp_ep.md).

    python benchmarks/dp_ep.py [--layers 4] [--hidden 512] [--rounds 3] \\
        [--concurrency 8,32] [--input-len 64] [--output-len 32] [--result-file F]

Both engines run in this process as the server runs them (``DPAsyncLLM`` with two
engine cores, ``AsyncLLM`` with one), each on two worker ranks of one torch thread: the
same two cores, the same experts per rank (half each). They are started once and take
turns: each round runs every concurrency on DP x EP, then on TP x EP. A run sends
``2 x concurrency`` requests of ``--input-len`` random prompt tokens and
``--output-len`` greedy output tokens, at most ``concurrency`` in flight; output
tokens/s is the figure, median over rounds.

``--eplb``: instead, DP=2 x EP=2 against the same with EPLB (``--enable-eplb
--num-redundant-experts 2 --eplb-window-size 32``) on the checkpoint with its routers
leaning on experts 1 and 2 (both on rank 0 as placed at first; tests' ``bias_router``),
so one rank runs nearly every expert row without EPLB; the placements EPLB chose are
printed at the end.

Bytes: every rank counts what it hands to collectives (``parallel_state.collective_bytes``:
the tensors it all-reduces; the hidden rows it sends by all-to-all, all and to other
ranks), read before and after each run through ``collective_rpc("collective_bytes")``.
The all-to-all is checked against the model

    bytes = 2 (dispatch + combine) x top_k x hidden x dtype bytes, per token per MoE layer

with tokens the forward's rows (prompt and decode tokens, each computed once). Dummy
steps of an idle replica send nothing. The all-reduce figure is the tensors' size
(a ring all-reduce moves 2 (n-1)/n of it per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_checkpoint(root: str, layers: int, hidden: int, experts: int, top_k: int,
                    dtype: str, biased: bool = False) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    from tokenizer_fixtures import make_tiny_tokenizer

    config = Qwen3MoeConfig(hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4,
                            head_dim=hidden // 8, vocab_size=4096,
                            max_position_embeddings=1024, num_experts=experts,
                            num_experts_per_tok=top_k, moe_intermediate_size=hidden,
                            intermediate_size=4 * hidden, norm_topk_prob=True,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    path = os.path.join(root, "moe")
    model.save_pretrained(path)
    make_tiny_tokenizer(path)
    if biased:
        sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "model"))
        from checkpoints import bias_router

        bias_router(path)
    total = sum(p.numel() for p in model.parameters())
    print(f"checkpoint: Qwen3-MoE, {layers} layers, hidden {hidden}, {experts} experts of "
          f"intermediate {hidden}, top-{top_k}, {total / 1e6:.0f}M parameters, {dtype}",
          flush=True)
    return path


async def run_load(engine, name: str, concurrency: int, input_len: int, output_len: int,
                   seed: int) -> dict:
    from loom import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(input_len)]
               for _ in range(2 * concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    limit = asyncio.Semaphore(concurrency)
    before = await collective_bytes(engine)

    async def one(i: int, prompt: list[int]) -> int:
        async with limit:
            last = None
            async for output in engine.add_request(f"{name}-{seed}-{i}", None, prompt,
                                                   params, stream=False):
                last = output
            return len(last.outputs[0].token_ids)

    start = time.perf_counter()
    generated = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    seconds = time.perf_counter() - start
    after = await collective_bytes(engine)
    moved = {key: after[key] - before[key] for key in after}
    return {"output_tokens_per_s": generated / seconds, "seconds": seconds,
            "output_tokens": generated, "forward_tokens": len(prompts) * (input_len + output_len - 1),
            **moved}


async def collective_bytes(engine) -> dict[str, int]:
    """Every rank's collective bytes summed (both replicas' ranks for DP)."""
    answer = await engine.control("collective_rpc", method="collective_bytes")
    # AsyncLLM: each rank's answer; DPAsyncLLM: each replica's list of them
    per_rank = [rank for item in answer for rank in (item if isinstance(item, list) else [item])]
    total: dict[str, int] = {}
    for rank in per_rank:
        for key, value in rank.items():
            total[key] = total.get(key, 0) + value
    return total


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--eplb", action="store_true",
                        help="DP x EP without and with EPLB, routers biased (see above)")
    args = parser.parse_args()

    from loom.async_llm import AsyncLLM
    from loom.dp_async_llm import DPAsyncLLM
    from loom.engine_args import EngineArgs

    load_at_start = list(os.getloadavg())  # other work on the cores disturbs the figures
    root = tempfile.mkdtemp(prefix="loom-dp-ep-")
    path = make_checkpoint(root, args.layers, args.hidden, args.experts, args.top_k,
                           args.dtype, biased=args.eplb)
    common = dict(model=path, dtype=args.dtype, max_model_len=512, max_num_seqs=64,
                  enable_prefix_caching=False, cpu_threads_per_rank=1,
                  distributed_executor_backend="mp")
    dp_config = EngineArgs(data_parallel_size=2, enable_expert_parallel=True,
                           **common).create_engine_config()
    if args.eplb:
        eplb_config = EngineArgs(data_parallel_size=2, enable_expert_parallel=True,
                                 enable_eplb=True, num_redundant_experts=2,
                                 eplb_window_size=32, **common).create_engine_config()
        engines = {"dp2_ep2": DPAsyncLLM(dp_config, log_requests=False),
                   "dp2_ep2_eplb": DPAsyncLLM(eplb_config, log_requests=False)}
    else:
        tp_config = EngineArgs(tensor_parallel_size=2, enable_expert_parallel=True,
                               **common).create_engine_config()
        engines = {"dp2_ep2": DPAsyncLLM(dp_config, log_requests=False),
                   "tp2_ep2": AsyncLLM(tp_config, log_requests=False)}
    for engine in engines.values():
        await engine.start()
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in engines}
    try:
        for name, engine in engines.items():  # a warm-up run each, not counted
            await run_load(engine, name, 4, args.input_len, 4, seed=-1)
        for round_index in range(args.rounds):
            for concurrency in levels:
                for name, engine in engines.items():
                    result = await run_load(engine, name, concurrency, args.input_len,
                                            args.output_len, seed=round_index)
                    runs[name][concurrency].append(result)
                    print(f"round {round_index} c={concurrency} {name}: "
                          f"{result['output_tokens_per_s']:.1f} tok/s, all-to-all "
                          f"{result['all_to_all'] / 2**20:.2f} MiB, all-reduce "
                          f"{result['all_reduce'] / 2**20:.2f} MiB", flush=True)
        placement = None
        if args.eplb:
            answer = await engines["dp2_ep2_eplb"].control("collective_rpc",
                                                           method="eplb_placement")
            placement = answer[0][0]
            print(f"EPLB: {placement['rearranged']} layer rearrangements; expert per slot "
                  f"({args.experts} + 2 slots, each rank half of them), each layer: "
                  f"{placement['placement']}", flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown()

    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    if args.eplb:
        summary = {concurrency: {name: statistics.median(
            r["output_tokens_per_s"] for r in runs[name][concurrency]) for name in engines}
            for concurrency in levels}
        for concurrency, row in summary.items():
            print(f"c={concurrency}: DP2xEP2 {row['dp2_ep2']:.1f} tok/s, with EPLB "
                  f"{row['dp2_ep2_eplb']:.1f} tok/s (x{row['dp2_ep2_eplb'] / row['dp2_ep2']:.2f})")
        if args.result_file:
            with open(args.result_file, "w") as file:
                json.dump({"args": vars(args), "summary": summary, "runs": runs,
                           "eplb_placement": placement,
                           "machine": {"loadavg_at_start": load_at_start,
                                       "loadavg_at_end": list(os.getloadavg())}},
                          file, indent=1)
        return
    summary = {}
    for concurrency in levels:
        row = {}
        for name in engines:
            results = runs[name][concurrency]
            first = results[0]
            model = (2 * args.top_k * args.hidden * dtype_bytes * args.layers
                     * first["forward_tokens"])
            row[name] = {
                "output_tokens_per_s": statistics.median(r["output_tokens_per_s"]
                                                         for r in results),
                "all_to_all_bytes_per_run": first["all_to_all"],
                "all_to_all_remote_bytes_per_run": first["all_to_all_remote"],
                "all_reduce_bytes_per_run": first["all_reduce"],
                "forward_tokens_per_run": first["forward_tokens"],
                "all_to_all_model_bytes": model if name == "dp2_ep2" else 0,
            }
        row["dp_over_tp"] = (row["dp2_ep2"]["output_tokens_per_s"]
                             / row["tp2_ep2"]["output_tokens_per_s"])
        summary[concurrency] = row
        print(f"c={concurrency}: DP2xEP2 {row['dp2_ep2']['output_tokens_per_s']:.1f} tok/s, "
              f"TP2xEP2 {row['tp2_ep2']['output_tokens_per_s']:.1f} tok/s "
              f"(x{row['dp_over_tp']:.2f}); all-to-all {row['dp2_ep2']['all_to_all_bytes_per_run']:,} "
              f"B (model {row['dp2_ep2']['all_to_all_model_bytes']:,} B), of which to the other "
              f"rank {row['dp2_ep2']['all_to_all_remote_bytes_per_run']:,} B; TP all-reduce "
              f"{row['tp2_ep2']['all_reduce_bytes_per_run']:,} B", flush=True)
    load = {"loadavg_at_start": load_at_start, "loadavg_at_end": list(os.getloadavg()),
            "cores": os.cpu_count()}
    print(f"load average (1, 5, 15 min) at start {load_at_start}, at end "
          f"{load['loadavg_at_end']} on {load['cores']} cores")
    if args.result_file:
        with open(args.result_file, "w") as file:
            json.dump({"args": vars(args), "machine": load, "summary": summary, "runs": runs},
                      file, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
