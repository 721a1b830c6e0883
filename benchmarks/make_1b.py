"""A 1B-class random Llama for benchmarks, as a Hugging Face directory and GGUF files.

    python benchmarks/make_1b.py [--out /work/bench-envs/models] [--types Q8_0 Q4_0]

The shapes of a public 1B Llama-architecture model (hidden 2048, 16 layers, 32 query
and 8 KV heads, MLP 8192, tied embeddings) with SmolLM2's vocabulary (49,152): 1.07B
parameters, random bf16 weights (speed does not depend on their values). The tokenizer
is the default model's (loom's conversion of its GGUF tokenizer). Then llama.cpp's own
``convert_hf_to_gguf.py`` writes a BF16 GGUF and ``llama-quantize`` each of ``--types``
(benchmarks/setup_baselines.sh builds them; llama.cpp is a benchmark tool only).
Writes llama-1b-random/ and llama-1b-random-{bf16,q8_0,q4_0}.gguf under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ENVS = os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs")
LLAMA_SRC = os.path.join(ENVS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")


def make_checkpoint(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from loom.default_model import default_model_path
    from loom.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, torch_dtype="bfloat16")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    model.save_pretrained(path)
    load_tokenizer(default_model_path()).hf.save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ENVS, "models"))
    parser.add_argument("--types", nargs="*", default=["Q8_0", "Q4_0"])
    parser.add_argument("--llama-bin", default=os.path.join(ENVS, "llama.cpp", "bin"))
    args = parser.parse_args()
    hf_dir = os.path.join(args.out, "llama-1b-random")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        make_checkpoint(hf_dir)
    bf16 = os.path.join(args.out, "llama-1b-random-bf16.gguf")
    if not os.path.exists(bf16):
        subprocess.run([sys.executable, os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"), hf_dir,
                        "--outtype", "bf16", "--outfile", bf16], check=True)
    for kind in args.types:
        target = os.path.join(args.out, f"llama-1b-random-{kind.lower()}.gguf")
        if not os.path.exists(target):
            subprocess.run([os.path.join(args.llama_bin, "llama-quantize"), bf16, target, kind],
                           check=True)
    print("\n".join(sorted(os.path.join(args.out, name) for name in os.listdir(args.out)
                           if name.startswith("llama-1b-random"))))


if __name__ == "__main__":
    main()
