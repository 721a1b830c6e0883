"""``loom bench throughput`` and ``loom bench latency``: the engine in this process, no HTTP.

throughput: ``LLM.generate`` over ``--num-prompts`` requests (fixed or mixed lengths,
any dataset of ``datasets.py``), every request submitted at once, each generating
exactly its output length (``ignore_eos``). Reports requests/s and tokens/s over the
whole run, after one warm-up request.

latency: one batch of ``--batch-size`` identical-length requests (several sizes may be
given; one engine serves them all, each shape warmed up first), timed step by step:

    | prefill steps (until every request has its first token) | decode steps ... |

prefill time = sum of the first region's steps; decode step = median of the rest.
Each is the median over ``--num-iters`` batches after ``--num-iters-warmup``. With
speculative decoding a decode step can give a request several tokens: decode tokens/s
is the mean output tokens of the batch per decode step over the median step.
``--dataset-name repeat`` times prompts that ask to copy code (drafts help).

Both report the engine's speculative-decoding acceptance over the measured run
(``metrics.spec_decode_metrics``) when speculation is on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from loom.bench.datasets import make_requests
from loom.bench.metrics import format_spec_decode, spec_decode_metrics


def _build_llm(args: argparse.Namespace):
    from loom import LLM
    from loom.engine_args import EngineArgs

    started = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    return llm, time.perf_counter() - started


def _spec_decode_counters(llm) -> tuple[int, int, int]:
    stats = llm.engine.engine_core.get_stats()
    return (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens)


def _write(record: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def throughput_main(args: argparse.Namespace) -> int:
    from loom import SamplingParams

    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_len
    llm, load_s = _build_llm(args)
    try:
        requests = make_requests(args, llm.get_tokenizer())
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                  for r in requests]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        spec_before = _spec_decode_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
        spec = spec_decode_metrics(spec_before, _spec_decode_counters(llm))
    finally:
        llm.shutdown()
    num_input = sum(len(r.prompt_token_ids) for r in requests)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    record = {
        "label": args.label, "model": args.model, "dataset_name": args.dataset_name,
        "num_prompts": len(requests), "dtype": llm.engine.config.model.dtype,
        "max_num_seqs": args.max_num_seqs,
        "load_s": load_s, "elapsed_s": elapsed,
        "total_input_tokens": num_input, "total_output_tokens": num_output,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
        "speculative_config": args.speculative_config, **spec,
    }
    print(f"Throughput: {record['requests_per_s']:.2f} requests/s, "
          f"{record['total_tokens_per_s']:.1f} total tokens/s, "
          f"{record['output_tokens_per_s']:.1f} output tokens/s")
    if spec:
        print(format_spec_decode(record))
    _write(record, args.result_file)
    return 0


def _time_batch(engine, prompt_ids: list[list[int]], output_len: int,
                tag: str) -> tuple[float, list[float], int]:
    """(prefill seconds, decode step seconds, decode tokens) of one batch run to completion."""
    from loom import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    waiting_first = set()
    for i, ids in enumerate(prompt_ids):
        request_id = f"{tag}-{i}"
        engine.add_request(request_id, {"prompt_token_ids": ids}, params, stream=True)
        waiting_first.add(request_id)
    prefill_s = 0.0
    decode_steps: list[float] = []
    decode_tokens = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if waiting_first:
            prefill_s += elapsed
            waiting_first.difference_update(o.request_id for o in outputs)
        else:
            decode_steps.append(elapsed)
            decode_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return prefill_s, decode_steps, decode_tokens


def latency_main(args: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_size) < 1:
        raise ValueError("--batch-size must be at least 1")
    llm, load_s = _build_llm(args)
    records = []
    try:
        from loom.bench.datasets import PromptMaker, RepeatPromptMaker

        maker_class = RepeatPromptMaker if args.dataset_name == "repeat" else PromptMaker
        maker = maker_class(llm.get_tokenizer(), np.random.default_rng(args.seed))
        # Fresh prompts for every batch, so the prefix cache never shortens a prefill (but
        # for the chat template and instruction repeat prompts share).
        def batch(size: int) -> list[list[int]]:
            return [maker.make(args.input_len)[1] for _ in range(size)]

        for warmup in range(args.num_iters_warmup):
            for size in args.batch_size:  # every shape once, with a short output
                _time_batch(llm.engine, batch(size), min(8, args.output_len), f"w{warmup}-{size}")
        for size in args.batch_size:
            spec_before = _spec_decode_counters(llm)
            records.append(_latency_at(llm.engine, size, batch, args))
            records[-1].update(spec_decode_metrics(spec_before, _spec_decode_counters(llm)))
            if format_spec_decode(records[-1]):
                print(f"  {format_spec_decode(records[-1])}", flush=True)
    finally:
        llm.shutdown()
    record = {"label": args.label, "model": args.model, "dtype": llm.engine.config.model.dtype,
              "dataset_name": args.dataset_name, "input_len": args.input_len,
              "output_len": args.output_len, "num_iters": args.num_iters,
              "speculative_config": args.speculative_config, "load_s": load_s,
              "results": records}
    _write(record, args.result_file)
    return 0


def _latency_at(engine, batch_size: int, batch, args: argparse.Namespace) -> dict[str, Any]:
    prefills, steps, e2e = [], [], []
    decode_tokens = prompt_tokens = 0
    for iteration in range(args.num_iters):
        prompts = batch(batch_size)
        prompt_tokens += sum(len(ids) for ids in prompts)
        start = time.perf_counter()
        prefill_s, decode_steps, tokens = _time_batch(engine, prompts, args.output_len,
                                                      f"b{batch_size}-{iteration}")
        e2e.append(time.perf_counter() - start)
        prefills.append(prefill_s)
        steps.extend(decode_steps)
        decode_tokens += tokens
    prefill = statistics.median(prefills)
    step = statistics.median(steps) if steps else float("nan")
    tokens_per_step = decode_tokens / len(steps) if steps else float("nan")
    total = statistics.median(e2e)
    record = {
        "batch_size": batch_size, "median_prefill_s": prefill,
        "prefill_tokens_per_s": prompt_tokens / args.num_iters / prefill,
        "median_decode_step_s": step,
        "p90_decode_step_s": float(np.percentile(steps, 90)) if steps else float("nan"),
        "decode_tokens_per_step": tokens_per_step,
        "decode_tokens_per_s": tokens_per_step / step if steps else float("nan"),
        "median_e2e_s": total, "output_tokens_per_s": batch_size * args.output_len / total,
    }
    print(f"Latency (batch {batch_size}, {args.input_len} in, {args.output_len} out): "
          f"prefill {prefill * 1000:.1f} ms ({record['prefill_tokens_per_s']:.0f} tok/s), "
          f"decode step {step * 1000:.2f} ms, {tokens_per_step:.2f} tokens "
          f"({record['decode_tokens_per_s']:.1f} tok/s), "
          f"end to end {total:.2f} s ({record['output_tokens_per_s']:.1f} output tok/s)",
          flush=True)
    return record
