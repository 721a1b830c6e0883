"""The MoE layer's expert path: grouped by expert (fused_experts) against a loop over
experts with a mask per expert (loop_over_experts, Hugging Face's shape), and against a
dense MLP with the same active parameters (top_k * moe_intermediate), interleaved,
medians of repeated rounds.

    python benchmarks/moe.py [--threads 1] [--dtype bfloat16] [--rounds 30]
    python benchmarks/moe.py --model [--layers 8] [--batch 1,8]   # whole-model decode

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
from loom.model.layers.weight_forms import linear, pack_weight, select_form


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

    # as loom's layers hold them: each expert's matrices in the form select_form picks
    forms = [(select_form(w13[e], w13.device, dtype), select_form(w2[e], w2.device, dtype))
             for e in range(experts)]
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
                    lambda: fused_experts(x, w13, w2, weights, ids, 0, forms), reps))
                times["loop"].append(_time(lambda: loop_over_experts(x, w13, w2, weights, ids), reps))
                times["dense"].append(_time(lambda: dense(x), reps))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {num_tokens} | {med['grouped']:.3f} | {med['loop']:.3f} | "
                  f"{med['dense']:.3f} | {med['loop'] / med['grouped']:.2f}x | "
                  f"{med['grouped'] / med['dense']:.2f}x |")




def model_main() -> None:
    """``--model``: whole-model decode, a random Qwen3-MoE checkpoint against a dense
    Qwen3 of the same active size (intermediate = top_k * moe_intermediate), bf16,
    in-process LLM, interleaved rounds; tokens/s medians."""
    import tempfile

    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from loom import LLM, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(hidden_size=1024, num_hidden_layers=args.layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, vocab_size=32000,
                  max_position_embeddings=1024, tie_word_embeddings=True)
    configs = {"moe": Qwen3MoeConfig(**common, num_experts=32, num_experts_per_tok=4,
                                     moe_intermediate_size=512, intermediate_size=2048,
                                     norm_topk_prob=True),
               "dense": Qwen3Config(**common, intermediate_size=4 * 512)}
    root = tempfile.mkdtemp(prefix="loom-moe-bench-")
    paths = {}
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        total = sum(p.numel() for p in model.parameters())
        paths[name] = f"{root}/{name}"
        model.save_pretrained(paths[name])
        print(f"{name}: {total / 1e6:.0f}M parameters")
        del model
    llms = {name: LLM(path, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True,
                      enable_prefix_caching=False) for name, path in paths.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in map(int, args.batch.split(",")):
        prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * args.max_tokens / (time.perf_counter() - start))
        moe, dense = (statistics.median(rates[n]) for n in ("moe", "dense"))
        print(f"batch {batch}: MoE {moe:.1f} tokens/s, dense (same active) {dense:.1f} "
              f"tokens/s, dense/MoE {dense / moe:.2f}x")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    import sys

    model_main() if "--model" in sys.argv else main()
