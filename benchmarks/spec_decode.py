"""Speculative decoding speed-up on a workload where drafts help: the model is asked to
copy a passage it was just shown (code, so prompt lookup finds long matches).

    python benchmarks/spec_decode.py [--model PATH] [--batch-sizes 1 4] [--k 2 4]

For each batch size, runs the same greedy requests without speculation and with n-gram
speculation (each k), interleaved, ``--repeats`` times, in one process; reports the best
and the median output tokens/s (the best is the least disturbed run on a shared
machine), the best's ratio to no speculation, forward steps per request, the
acceptance rate, and whether the greedy text is identical. Results are in
benchmarks/spec_decode.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from loom import LLM, SamplingParams
from loom.default_model import default_model_path

PASSAGE = '''def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    return merge_sorted(merge_sort(items[:middle]), merge_sort(items[middle:]))
'''


def make_prompts(batch_size: int) -> list[str]:
    names = ["merge_sorted", "merge_sort", "combine", "sort_items", "join_sorted", "msort",
             "merge_lists", "sort_list"]
    prompts = []
    for i in range(batch_size):
        passage = PASSAGE.replace("merge_sorted", names[i % len(names)])
        prompts.append(f"{passage}\n\n# The same code, copied exactly:\n\n"
                       f"{passage.splitlines()[0]}\n")
    return prompts


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[str], int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return num_tokens / elapsed, [o.outputs[0].text for o in outputs], num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model or default_model_path()

    engines = {"none": LLM(model, max_model_len=1024, seed=0, dtype=args.dtype)}
    for k in args.k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
        engines[f"ngram k={k}"] = LLM(model, max_model_len=1024, seed=0, dtype=args.dtype,
                                      speculative_config=spec)
    print(f"model {model} ({args.dtype}); greedy, {args.max_tokens} new tokens per request, "
          f"median of {args.repeats} runs, interleaved\n")
    print("| batch | speculation | best tok/s | median tok/s | speed-up (best) | steps/request "
          "| acceptance | same text |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for batch_size in args.batch_sizes:
        prompts = make_prompts(batch_size)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        texts: dict[str, list[str]] = {}
        for name, llm in engines.items():
            run(llm, prompts, 8)  # warm-up
        before = {name: llm.engine.engine_core.get_stats() for name, llm in engines.items()}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                rate, texts[name], _ = run(llm, prompts, args.max_tokens)
                rates[name].append(rate)
        baseline = max(rates["none"])
        for name, llm in engines.items():
            stats = llm.engine.engine_core.get_stats()
            drafted = stats.spec_decode_num_draft_tokens - before[name].spec_decode_num_draft_tokens
            accepted = (stats.spec_decode_num_accepted_tokens
                        - before[name].spec_decode_num_accepted_tokens)
            acceptance = f"{accepted / drafted:.0%}" if drafted else "-"
            best, median = max(rates[name]), statistics.median(rates[name])
            # forward steps per request per run: tokens / (1 + accepted per step)
            steps = args.max_tokens - accepted / (args.repeats * batch_size)
            print(f"| {batch_size} | {name} | {best:.1f} | {median:.1f} | "
                  f"{best / baseline:.2f}x | {steps:.0f} | {acceptance} | "
                  f"{texts[name] == texts['none']} |", flush=True)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
