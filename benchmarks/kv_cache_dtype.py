"""Decode speed of the default model over a bf16 KV cache and an int8 one
(--kv-cache-dtype), interleaved: each round one process per dtype, one after the other;
the median over rounds. Each process prefills its prompts once (later runs hit the
prefix cache), then times three runs of 64 greedy tokens and reports the best.

    python benchmarks/kv_cache_dtype.py --batch 1 --rounds 5
    python benchmarks/kv_cache_dtype.py --batch 32 --rounds 5
    python benchmarks/kv_cache_dtype.py --kernel   # one paged_attention call: bf16, int8,
                                                   # fp8_e4m3 and fp8_e5m2 caches

Each request: a 512-token prompt, then 64 greedy tokens; max_model_len 1024. --kernel:
SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16), decode
steps of 1 and 32 requests over 576-token contexts, bf16, microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import os
import time

NEW_TOKENS = 64
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]


def kernel_times() -> None:
    import torch
    from model.test_kernels import _paged_case

    from loom.kernels import native_ops
    from loom.model.attention.torch_backend import quantize_kv_rows

    ops = native_ops()
    for batch in (1, 32):
        cache, metadata, q, _, _ = _paged_case([576] * batch, [1] * batch, 9, 3, 64, 16,
                                               torch.bfloat16)
        out = torch.empty_like(q)
        for name, kv_cache in (("bf16", cache), ("int8", quantize_kv_rows(cache)),
                               ("fp8_e4m3", quantize_kv_rows(cache, torch.float8_e4m3fn)),
                               ("fp8_e5m2", quantize_kv_rows(cache, torch.float8_e5m2))):
            def call():
                ops.paged_attention(out, q, kv_cache, metadata.block_table, metadata.seq_lens,
                                    metadata.query_start_loc, 0.125, 1 << 30)
            for _ in range(20):
                call()
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(100):
                    call()
                rounds.append((time.perf_counter() - start) / 100 * 1e6)
            print(f"batch {batch}, 576-token contexts, {name} cache: "
                  f"{statistics.median(rounds):.1f} us a call (median of 5 x 100)")


def child(dtype: str, batch: int, model: str | None) -> None:
    from loom import LLM, SamplingParams

    kwargs = dict(max_model_len=1024, max_num_seqs=batch, kv_cache_dtype=dtype)
    llm = LLM(model, **kwargs) if model else LLM(**kwargs)
    prompts = [{"prompt_token_ids": [(i * 7 + j * 13) % 5000 + 10 for j in range(512)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
    finally:
        llm.shutdown()
    print(json.dumps({"rate": batch * NEW_TOKENS / best,
                      "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernel", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernel:
        kernel_times()
        return
    if args.child:
        child(args.child, args.batch, args.model)
        return
    rates: dict[str, list[float]] = {"auto": [], "int8": []}
    tokens = {}
    for _ in range(args.rounds):
        for dtype in rates:
            command = [sys.executable, __file__, "--child", dtype, "--batch", str(args.batch)]
            if args.model:
                command += ["--model", args.model]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            rates[dtype].append(result["rate"])
            tokens[dtype] = result["tokens"]
    for dtype, values in rates.items():
        print(f"kv_cache_dtype={dtype} batch {args.batch}: {statistics.median(values):.1f} "
              f"tokens/s (median of {args.rounds} rounds; each {sorted(round(v) for v in values)})")
    same = sum(a == b for x, y in zip(tokens["auto"], tokens["int8"]) for a, b in zip(x, y))
    print(f"greedy tokens equal at {same} of {args.batch * NEW_TOKENS} positions")


if __name__ == "__main__":
    main()
