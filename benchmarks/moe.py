"""The MoE layer's expert path: grouped by expert (fused_experts) against a loop over
experts with a mask per expert (loop_over_experts, Hugging Face's shape), and against a
dense MLP with the same active parameters (top_k * moe_intermediate), interleaved,
medians of repeated rounds.

    python benchmarks/moe.py [--threads 1] [--dtype bfloat16] [--rounds 30]

Shapes of a Qwen3-MoE-like layer of about 1B total parameters over 24 layers (hidden
1024, 32 experts of intermediate 512, top-4: ~50M expert parameters a layer).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from loom.model.layers.fused_moe import (MoESpec, fused_experts, loop_over_experts,
                                         select_experts)
from loom.model.layers.linear import linear, pack_weight


def _time(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", default="1,8,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hidden, experts, inter, top_k = args.hidden, args.experts, args.intermediate, args.top_k
    torch.manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) * 0.02).to(dtype)
    gate = torch.randn(experts, hidden) * 0.02
    dense_up = (torch.randn(2 * inter * top_k, hidden) * 0.02).to(dtype)
    dense_down = (torch.randn(hidden, inter * top_k) * 0.02).to(dtype)
    spec = MoESpec(experts, top_k, inter)

    # as loom's layers run them: packed for the CPU bf16 matmul where that applies
    packed = [(pack_weight(w13[e]), pack_weight(w2[e])) for e in range(experts)]
    packed = packed if packed[0][0] is not None else None
    dense_packed = (pack_weight(dense_up), pack_weight(dense_down))

    def dense(x):
        g, u = linear(x, dense_up, packed=dense_packed[0]).chunk(2, dim=-1)
        return linear(F.silu(g) * u, dense_down, packed=dense_packed[1])

    print(f"hidden {hidden}, {experts} experts x intermediate {inter}, top-{top_k}, "
          f"{args.dtype}, {args.threads} thread(s); medians of {args.rounds} rounds, ms")
    print("| tokens | grouped | loop over experts | dense, same active | loop/grouped | "
          "grouped/dense |")
    print("|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for num_tokens in map(int, args.tokens.split(",")):
            x = torch.randn(num_tokens, hidden).to(dtype)
            weights, ids = select_experts(F.linear(x.float(), gate), spec, None)
            reps = max(1, 64 // num_tokens)
            times = {"grouped": [], "loop": [], "dense": []}
            for _ in range(args.rounds):  # interleaved
                times["grouped"].append(_time(
                    lambda: fused_experts(x, w13, w2, weights, ids, 0, packed), reps))
                times["loop"].append(_time(lambda: loop_over_experts(x, w13, w2, weights, ids), reps))
                times["dense"].append(_time(lambda: dense(x), reps))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {num_tokens} | {med['grouped']:.3f} | {med['loop']:.3f} | "
                  f"{med['dense']:.3f} | {med['loop'] / med['grouped']:.2f}x | "
                  f"{med['grouped'] / med['dense']:.2f}x |")


if __name__ == "__main__":
    main()
