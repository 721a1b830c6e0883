"""Baseline: Hugging Face ``transformers`` ``generate`` with static batches, bf16, greedy.

Two modes, both printing one JSON object (and writing it with ``--result-file``):

- ``static`` (default): batches of ``--batch-sizes`` identical-length requests,
  ``--input-len`` prompt tokens, exactly ``--output-len`` new tokens (min = max new
  tokens, the ``ignore_eos`` of generate). Reports output tok/s including prefill,
  prefill time (a generate of one token) and the decode rate after it; medians over
  ``--iters``.
- ``mixed``: ``--num-prompts`` requests of mixed lengths (``--range-ratio`` around
  the input/output lengths, the same generator and seed as ``loom bench throughput
  --random-range-ratio``), served in static batches of ``--batch-size`` in arrival
  order: each batch is left-padded to its longest prompt and runs until its longest
  output is done; only each request's own output tokens count.

Prompts are ``loom.bench.datasets`` random prompts (seed 0) from the model's tokenizer,
the same ones the loom and vLLM runs use.

    python benchmarks/baseline_transformers.py --model /work/bench-envs/models/smollm2-135m-bf16
    python benchmarks/baseline_transformers.py --model DIR --mode mixed --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loom.bench.datasets import random_requests


def load(model: str, dtype: torch.dtype):
    if model.endswith(".gguf"):
        folder, name = os.path.split(model)
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = model, {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    return model, tokenizer


def generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds to generate exactly ``new_tokens`` for every prompt, as one padded batch."""
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - start


def static(args, model, tokenizer) -> dict:
    results = []
    for batch_size in args.batch_sizes:
        full, prefill = [], []
        for iteration in range(args.warmup + args.iters):
            requests = random_requests(batch_size, args.input_len, args.output_len,
                                       tokenizer=tokenizer, seed=args.seed + iteration)
            prompts = [r.prompt_token_ids for r in requests]
            if iteration < args.warmup:  # warm this shape up with a short output
                generate(model, tokenizer, prompts, min(8, args.output_len))
                continue
            prefill.append(generate(model, tokenizer, prompts, 1))
            full.append(generate(model, tokenizer, prompts, args.output_len))
        total_s, prefill_s = statistics.median(full), statistics.median(prefill)
        row = {"batch_size": batch_size, "median_e2e_s": total_s, "median_prefill_s": prefill_s,
               "output_tokens_per_s": batch_size * args.output_len / total_s,
               "prefill_tokens_per_s": batch_size * args.input_len / prefill_s,
               "decode_tokens_per_s": batch_size * (args.output_len - 1) / (total_s - prefill_s)}
        print(json.dumps(row), flush=True)
        results.append(row)
    return {"mode": "static", "input_len": args.input_len, "output_len": args.output_len,
            "results": results}


def mixed(args, model, tokenizer) -> dict:
    requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, tokenizer=tokenizer, seed=args.seed)
    warm = [requests[0].prompt_token_ids]
    generate(model, tokenizer, warm, 2)
    start = time.perf_counter()
    for i in range(0, len(requests), args.batch_size):
        batch = requests[i:i + args.batch_size]
        generate(model, tokenizer, [r.prompt_token_ids for r in batch],
                 max(r.output_len for r in batch))
    elapsed = time.perf_counter() - start
    num_output = sum(r.output_len for r in requests)
    num_input = sum(r.prompt_len for r in requests)
    return {"mode": "mixed", "num_prompts": len(requests), "batch_size": args.batch_size,
            "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "elapsed_s": elapsed,
            "total_input_tokens": num_input, "total_output_tokens": num_output,
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": num_output / elapsed,
            "total_tokens_per_s": (num_input + num_output) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: the default model's GGUF)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mode", default="static", choices=["static", "mixed"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--batch-size", type=int, default=32, help="mixed: the static batch")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = default_model_path()
    start = time.perf_counter()
    model, tokenizer = load(args.model, getattr(torch, args.dtype))
    load_s = time.perf_counter() - start
    record = static(args, model, tokenizer) if args.mode == "static" else \
        mixed(args, model, tokenizer)
    record.update({"engine": "transformers", "model": args.model, "dtype": args.dtype,
                   "load_s": load_s, "torch_threads": torch.get_num_threads()})
    print(json.dumps(record, indent=2))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
