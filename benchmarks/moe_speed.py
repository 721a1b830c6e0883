"""A Qwen3-MoE-shaped random checkpoint of about 1B parameters: loom's batch-1 and
batch-N decode against a dense model with the same active parameters (loom, same run)
and against llama.cpp on the same checkpoint converted by llama.cpp's own converter.

    python benchmarks/moe_speed.py [--out /work/bench-envs/models] [--repeats 2] [--batch 8]

Shapes (``--layers`` 24): hidden 1024, 16 query / 4 KV heads of 64, 32 experts of
intermediate 512, top-4, SmolLM2's vocabulary (49,152; the default model's tokenizer,
which the converter recognises), untied head: about 1.4B parameters, 0.35B active per
token. The dense twin is a Qwen3 with the same attention and one MLP of 4 x 512 = 2048,
so its every parameter is active and equals the MoE's active count. Random bf16
weights (speed does not depend on their values). Per repeat, in an order rotated each
repeat: ``loom bench latency`` on each (batch 1 and ``--batch``, 128 in, 128 out),
llama.cpp's ``llama-bench`` (tg128: batch-1 decode) and ``llama-batched-bench``
(``--batch`` sequences) on the BF16 GGUF, ``--threads`` threads each. Medians; raw
results in benchmarks/results/moe_speed.json. llama.cpp comes from
benchmarks/setup_baselines.sh; it is a benchmark tool, never a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from make_1b import ENVS, LLAMA_SRC  # noqa: E402
from quantized import run_llama_batched, run_llama_bench, run_loom  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 4, 64
EXPERTS, TOP_K, EXPERT_INTER = 32, 4, 512


def make_checkpoints(out: str, layers: int) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from loom.default_model import default_model_path
    from loom.tokenizer import load_tokenizer

    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=49152,
                  max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
    configs = {
        f"qwen3moe-{layers}l-random": Qwen3MoeConfig(
            **common, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_INTER, intermediate_size=TOP_K * EXPERT_INTER,
            norm_topk_prob=True),
        f"qwen3dense-{layers}l-active-twin": Qwen3Config(
            **common, intermediate_size=TOP_K * EXPERT_INTER),
    }
    tokenizer = load_tokenizer(default_model_path()).hf
    paths = []
    for name, config in configs.items():
        path = os.path.join(out, name)
        paths.append(path)
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
        total = sum(p.numel() for p in model.parameters())
        print(f"{name}: {total / 1e9:.2f}B parameters", flush=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths[0], paths[1]


def convert(hf_dir: str) -> str:
    gguf = hf_dir + "-bf16.gguf"
    if not os.path.exists(gguf):
        subprocess.run([sys.executable, os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"),
                        hf_dir, "--outtype", "bf16", "--outfile", gguf], check=True)
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ENVS, "models"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bin", default=os.path.join(ENVS, "llama.cpp", "bin"))
    args = parser.parse_args()
    moe_dir, dense_dir = make_checkpoints(args.out, args.layers)
    moe_gguf = convert(moe_dir)
    b = args.batch
    runs = {
        "loom moe": lambda: run_loom(moe_dir, "auto", [1, b]),
        "loom dense twin": lambda: run_loom(dense_dir, "auto", [1, b]),
        "llama.cpp moe": lambda: run_llama_bench(args.llama_bin, moe_gguf, args.threads),
        f"llama.cpp moe batched {b}": lambda: run_llama_batched(args.llama_bin, moe_gguf,
                                                                args.threads, b),
    }
    names, repeats = list(runs), []
    for repeat in range(args.repeats):
        results = {}
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            results[name] = runs[name]()
            print(f"repeat {repeat} {name}: {results[name]}", flush=True)
        repeats.append(results)

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in repeats)

    summary = {
        "moe_b1": median("loom moe", "b1_decode_tokens_per_s"),
        "dense_twin_b1": median("loom dense twin", "b1_decode_tokens_per_s"),
        f"moe_b{b}": median("loom moe", f"b{b}_decode_tokens_per_s"),
        f"dense_twin_b{b}": median("loom dense twin", f"b{b}_decode_tokens_per_s"),
        "llama_cpp_moe_b1": median("llama.cpp moe", "tg128_tokens_per_s"),
        f"llama_cpp_moe_b{b}": median(f"llama.cpp moe batched {b}", "output_tokens_per_s"),
    }
    summary["moe_over_dense_b1"] = summary["moe_b1"] / summary["dense_twin_b1"]
    summary["moe_over_llama_cpp_b1"] = summary["moe_b1"] / summary["llama_cpp_moe_b1"]
    summary[f"moe_over_llama_cpp_b{b}"] = summary[f"moe_b{b}"] / summary[f"llama_cpp_moe_b{b}"]
    for key, value in summary.items():
        print(f"{key:>26}: {value:.2f}")
    with open(os.path.join(HERE, "results", "moe_speed.json"), "w") as f:
        json.dump({"args": vars(args), "repeats": repeats, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
