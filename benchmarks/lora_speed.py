"""LoRA adapters against the base model, interleaved: decode tokens per second at batch 1
with an adapter, and 8 concurrent requests over 4 adapters, each beside the base model
alone (an engine without LoRA) at the same concurrency; every process's peak memory.

    python benchmarks/lora_speed.py --model /work/bench-envs/models/llama-1b-random \\
        [--rank 16] [--rounds 3] [--result-file results/lora-speed.json]

The adapters (rank ``--rank`` on every linear: q, k, v, o, gate, up, down; random A and
B) are written once with PEFT into ``--adapters-dir``. Each figure is one fresh process:
a 32-token prompt (8 of them for the concurrent case, distinct), 64 new tokens each, greedy,
timed after a warm-up generation of the same shape; tokens per second of output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from fresh_process import run_in_child

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model: str, directory: str, rank: int, count: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [os.path.join(directory, f"adapter{i}") for i in range(count)]
    if all(os.path.exists(os.path.join(p, "adapter_config.json")) for p in paths):
        return paths
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                     target_modules=TARGETS,
                                                     init_lora_weights=False))
        peft_model.save_pretrained(path)
        base = peft_model.unload()
    return paths


def run(model: str, adapters: list[str], case: str, batch: int, rank: int = 16) -> dict:
    """One figure in this process: ``case`` base (no LoRA) or lora, ``batch`` requests."""
    from loom import LLM, LoRARequest, SamplingParams

    lora = case == "lora"
    kwargs = dict(dtype="bfloat16", enable_warm_up=False, max_model_len=256)
    if lora:
        kwargs |= dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                       lora_modules=[f"a{i}={p}" for i, p in enumerate(adapters)])
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(32)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    requests = ([LoRARequest(f"a{i % len(adapters)}", i % len(adapters) + 1, adapters[i % len(adapters)])
                 for i in range(batch)] if lora else None)
    with LLM(model, **kwargs) as llm:
        llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tok_s": tokens / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--adapters-dir", default="/tmp/loom-lora-speed")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    adapters = write_adapters(args.model, args.adapters_dir, args.rank, 4)
    cases = [("base", 1), ("lora", 1), ("base", 8), ("lora", 8)]
    figures: dict[str, list] = {f"{case} b={batch}": [] for case, batch in cases}
    memory: dict[str, list] = {key: [] for key in figures}
    for index in range(args.rounds):
        for case, batch in cases:
            result = run_in_child("lora_speed", "run", args.model,
                                  adapters[:1] if batch == 1 else adapters, case, batch,
                                  args.rank)
            key = f"{case} b={batch}"
            figures[key].append(round(result["tok_s"], 2))
            memory[key].append(round(result["peak_rss_mib"]))
            print(f"round {index + 1} {key}: {result['tok_s']:.1f} tok/s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    ratios = {f"b={batch}": round(statistics.median(
        lora / base for lora, base in zip(figures[f"lora b={batch}"], figures[f"base b={batch}"])),
        3) for batch in (1, 8)}
    summary = {"command": "python benchmarks/lora_speed.py " + " ".join(sys.argv[1:]),
               "model": args.model, "rank": args.rank, "adapters": len(adapters),
               "output_tok_s": figures, "peak_rss_mib": memory,
               "median_ratio_lora_over_base": ratios}
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
