"""KV held by a long request when layers attend over a sliding window (blocks behind
the window freed early, KVCacheManager) against the same checkpoint with full
attention, step by step, and how many such requests a fixed amount of KV memory runs
at once without preemption.

    python benchmarks/sliding_window_kv.py [--family mistral|gemma3|both]
                                           [--prompt 4096] [--window 512] [--requests 4]

``mistral``: a random Mistral-shaped checkpoint (hidden 256, 4 layers, 4 query / 2 KV
heads of 64, every layer windowed: one block table) and its copy with
``sliding_window`` null. ``gemma3``: a random Gemma 3-shaped one (hidden 256, 6
layers, 5 local with window ``--window`` to 1 global, heads as above: a hybrid KV
cache, one full group and five sliding ones of one layer each) and its copy with
every layer global, which holds what one block table per request holds. One request
of ``--prompt`` tokens (chunked prefill, budget 512) plus 32 decoded tokens; then
``--requests`` such requests at once in the KV memory of one full-attention request.
Writes benchmarks/results/sliding_window_kv[_gemma3].{json,svg}. Counts are exact (the
scheduler's blocks in use after each step; a hybrid cache's blocks hold fewer layers,
so compare the MiB); times are wall clock on whatever host runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from loom import LLM, SamplingParams

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BLOCK_SIZE, BUDGET, NEW_TOKENS = 16, 512, 32


GEMMA3_LAYERS = 6  # five local, one global: layers_per_block 1 in the hybrid cache


def make_checkpoints(root: str, family: str, window: int, max_len: int) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024,
                 max_position_embeddings=max_len, sliding_window=window,
                 tie_word_embeddings=False)
    if family == "mistral":
        config = MistralConfig(num_hidden_layers=4, **shape)
    else:
        config = Gemma3TextConfig(num_hidden_layers=GEMMA3_LAYERS, query_pre_attn_scalar=64,
                                  **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    windowed, full = os.path.join(root, "windowed"), os.path.join(root, "full")
    model.save_pretrained(windowed)
    if family == "mistral":
        model.config.sliding_window = None
    else:
        model.config.layer_types = ["full_attention"] * GEMMA3_LAYERS
    model.save_pretrained(full)
    return windowed, full


def blocks_per_step(path: str, prompts: list[list[int]], num_blocks: int | None) -> dict:
    """Run ``prompts`` together; the pool's blocks in use after each step."""
    llm = LLM(path, dtype="float32", max_model_len=len(prompts[0]) + NEW_TOKENS + 16,
              block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, skip_tokenizer_init=True,
              enable_prefix_caching=False, num_gpu_blocks_override=num_blocks,
              enable_warm_up=False)
    engine, core = llm.engine, llm.engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    in_use, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        in_use.append(core.get_stats().num_blocks_in_use)
    elapsed = time.perf_counter() - start
    result = dict(blocks_in_use=in_use, peak_blocks=max(in_use), steps=len(in_use),
                  seconds=round(elapsed, 2), preemptions=core.get_stats().num_preemptions,
                  freed_early=core.scheduler.kv_cache.num_blocks_freed_early,
                  bytes_per_block=core.executor.kv_cache_bytes_per_block,
                  pool_blocks=core.num_blocks,
                  kv_cache_groups=list(core.scheduler.kv_cache.group_windows))
    llm.shutdown()
    return result


def write_svg(path: str, series: dict[str, list[int]], title: str) -> None:
    """A line chart of blocks in use per step, one line per series, no dependencies."""
    width, height, pad = 640, 360, 48
    max_x = max(len(v) for v in series.values()) - 1 or 1
    max_y = max(max(v) for v in series.values()) or 1
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f"]

    def xy(i: int, v: int) -> str:
        return (f"{pad + i * (width - 2 * pad) / max_x:.1f},"
                f"{height - pad - v * (height - 2 * pad) / max_y:.1f}")

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">{title}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
             'stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">engine step</text>',
             f'<text x="{pad - 6}" y="{pad}" text-anchor="end">{max_y}</text>',
             f'<text x="{pad - 6}" y="{height - pad}" text-anchor="end">0</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" '
             'text-anchor="middle">KV in use</text>']
    for n, (name, values) in enumerate(series.items()):
        color = colors[n % len(colors)]
        points = " ".join(xy(i, v) for i, v in enumerate(values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                     f'points="{points}"/>')
        parts.append(f'<text x="{width - pad - 4}" y="{pad + 16 * n}" text-anchor="end" '
                     f'fill="{color}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def measure(family: str, args: argparse.Namespace) -> None:
    max_len = args.prompt + NEW_TOKENS + 16
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1024, (args.prompt,), generator=generator).tolist()
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        windowed, full = make_checkpoints(root, family, args.window, max_len)
        one = {name: blocks_per_step(path, prompts[:1], None)
               for name, path in (("windowed", windowed), ("full", full))}
        # the KV memory of one full-attention request (the start-up check's minimum), in
        # each run's blocks: a hybrid cache's block holds 1 of the 6 layers
        pool = -(-max_len // BLOCK_SIZE)
        pools = {"windowed": pool * (GEMMA3_LAYERS if family == "gemma3" else 1),
                 "full": pool}
        many = {name: blocks_per_step(path, prompts, pools[name])
                for name, path in (("windowed", windowed), ("full", full))}
    report = dict(family=family, prompt=args.prompt, window=args.window,
                  block_size=BLOCK_SIZE, budget=BUDGET, new_tokens=NEW_TOKENS,
                  one_request=one, requests=args.requests, pool_blocks=pools,
                  many_requests=many)
    os.makedirs(RESULTS, exist_ok=True)
    name = "sliding_window_kv" + ("_gemma3" if family == "gemma3" else "")
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    # in MiB, since a hybrid cache's blocks are smaller
    series = {f"window {args.window}, blocks behind it freed": one["windowed"],
              "same checkpoint, full attention" if family == "mistral" else
              "same weights, every layer global": one["full"]}
    write_svg(os.path.join(RESULTS, f"{name}.svg"),
              {label: [n * run["bytes_per_block"] // 2**10 for n in run["blocks_in_use"]]
               for label, run in series.items()},
              f"{family}: one {args.prompt}-token prompt + {NEW_TOKENS} tokens, KiB of KV")
    mib = pool * one["full"]["bytes_per_block"] / 2 ** 20
    for label, runs in (("one request", one),
                        (f"{args.requests} requests, {mib:.1f} MiB", many)):
        for name, run in runs.items():
            mib = run["peak_blocks"] * run["bytes_per_block"] / 2 ** 20
            print(f"{family:>7} {label:>24} {name:>8}: peak {run['peak_blocks']:4d} blocks "
                  f"({mib:6.1f} MiB), {run['steps']} steps, {run['seconds']:.1f} s, "
                  f"{run['preemptions']} preemptions, {run['freed_early']} freed early")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("mistral", "gemma3", "both"), default="both")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for family in ("mistral", "gemma3") if args.family == "both" else (args.family,):
        measure(family, args)


if __name__ == "__main__":
    main()
