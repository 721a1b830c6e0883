"""Batch-1 decode step time of a Qwen3-MoE-shaped model (benchmarks/moe_speed.py's
shapes: hidden 1024, 16/4 heads of 64, 32 experts of 512, top-4; ``--layers`` layers,
a 1,024-token vocabulary) with the replayed forward (LOOM_NATIVE_LAYERS) off and on, against its dense
active twin (one MLP of 4 x 512), in one process, interleaved, ``--threads`` threads:
the per-step cost of the decoder layers without a server. Random bf16 weights.

    python benchmarks/moe_stack_step.py [--layers 4] [--steps 40] [--rounds 3]

Reports the minimum and median step per setting (the minimum is the figure that a
loaded host disturbs least).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from loom.envs import settings
    from loom.model.loader import load_hf_config, load_model
    from tests.model.paged import PagedDriver

    torch.set_num_threads(args.threads)
    common = dict(hidden_size=1024, num_hidden_layers=args.layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, vocab_size=1024,
                  max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
    configs = {"moe": Qwen3MoeConfig(**common, num_experts=32, num_experts_per_tok=4,
                                     moe_intermediate_size=512, intermediate_size=2048,
                                     norm_topk_prob=True),
               "dense": Qwen3Config(**common, intermediate_size=2048)}
    drivers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            path = os.path.join(tmp, name)
            hf.save_pretrained(path)
            del hf
            for native in ("0", "1"):
                if name == "dense" and native == "0":
                    continue
                os.environ["LOOM_NATIVE_LAYERS"] = native
                settings.cache_clear()
                model = load_model(path, load_hf_config(path), dtype=torch.bfloat16)
                driver = PagedDriver(model, num_blocks=(args.context + args.steps * args.rounds
                                                        ) // 16 + 4,
                                     block_size=16, dtype=torch.bfloat16)
                tokens = list(range(3, 3 + args.context))
                with torch.no_grad():
                    driver.step([(0, tokens, len(tokens))])
                drivers[f"{name} native={native}"] = (driver, tokens)
    times = {key: [] for key in drivers}
    for _ in range(args.rounds):
        for key, (driver, tokens) in drivers.items():
            with torch.no_grad():
                for _ in range(args.steps):
                    tokens.append(7)
                    start = time.perf_counter()
                    driver.step([(0, tokens, 1)])
                    times[key].append(time.perf_counter() - start)
    for key, values in times.items():
        print(f"{key}: {args.layers} layers, step min {min(values) * 1e3:.2f} ms, "
              f"median {statistics.median(values) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
