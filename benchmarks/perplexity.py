"""Perplexity of one GGUF file: loom (kept quantized, and dequantized in float32) beside
llama.cpp's ``llama-perplexity`` on the same file and text, by llama-perplexity's method;
and each engine's top-1 agreement with the same file dequantized to float32.

    python benchmarks/perplexity.py                       # the default Q4_1 file
    python benchmarks/perplexity.py --model F.gguf --ctx 512 --llama-bin DIR
    python benchmarks/perplexity.py --kv-cache-dtype int8  # and the kept file over it
    python benchmarks/perplexity.py --kv-cache-dtype int8 fp8_e4m3 fp8_e5m2  # each
    python benchmarks/perplexity.py --model 1b-q4_0.gguf --ctx 4096 --tokens 8192 \
        --kv-cache-dtype int8 --hf-overrides '{"max_position_embeddings": 4104}'

The text ships offline: Python standard library docstrings (tests/model/
test_quantization.py's, repeated to ``--tokens``). llama-perplexity splits the tokens
into chunks of ``--ctx``, puts BOS in place of each chunk's first token where the file's
tokenizer adds BOS (``tokenizer.ggml.add_bos_token``; SmolLM2's does not), and scores the
tokens at positions ctx/2 + 1 .. ctx - 1 of each chunk (255 of 512), each given
everything before it in the chunk; loom is scored the same way, on the same token ids
(llama.cpp's tokenizer is given the text loom's ids decode to, which encodes back to
the same ids). llama.cpp comes from benchmarks/setup_baselines.sh; a benchmark tool only.

Top-1 agreement, over the same scored positions: loom's kept file (bf16, the default)
against loom's float32 run of the dequantized file; llama.cpp's file against its own
float32 copy of it (``llama-quantize --allow-requantize F32``), by llama-perplexity's
``--kl-divergence`` ("Same top p"). So each engine is compared with itself in float32.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"),
                os.path.join(os.path.dirname(HERE), "tests", "model")]


def text(min_tokens: int, tokenizer) -> str:
    from model.test_quantization import stdlib_text

    base = stdlib_text()
    out = base
    while len(tokenizer.encode(out)) < min_tokens:
        out += "\n\n" + base
    return out


def chunk_bos(tokenizer) -> int | None:
    """BOS where the file's tokenizer puts it first (llama-perplexity then replaces each
    chunk's first token with it), else None."""
    bos = tokenizer.hf.bos_token_id
    return bos if bos is not None and tokenizer.hf("a")["input_ids"][:1] == [bos] else None


def loom_perplexity(model: str, token_ids: list[int], ctx: int, bos: int | None,
                    **kwargs) -> tuple[float, list[int]]:
    """(perplexity, the top-1 token at every scored position); ``bos``: put in place of
    each chunk's first token (None: the chunk as it is)."""
    from loom import LLM, SamplingParams

    llm = LLM(model, max_model_len=ctx + 8, enable_warm_up=False, **kwargs)
    nll, count, top1 = 0.0, 0, []
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
        for start in range(0, len(token_ids) - ctx + 1, ctx):
            chunk = token_ids[start:start + ctx]
            if bos is not None:
                chunk[0] = bos
            out = llm.generate([{"prompt_token_ids": chunk}], params, use_tqdm=False)[0]
            for position in range(ctx // 2 + 1, ctx):  # as llama-perplexity's process_logits
                logprobs = out.prompt_logprobs[position]
                nll -= logprobs[chunk[position]].logprob
                top1.append(max(logprobs.items(), key=lambda item: item[1].logprob)[0])
                count += 1
    finally:
        llm.shutdown()
    return math.exp(nll / count), top1


def llama_perplexity(bin_dir: str, model: str, path: str, ctx: int, threads: int,
                     cache_type: str | None = None) -> float:
    """llama-perplexity's estimate; ``cache_type`` (q8_0): its KV cache in that type (with
    flash attention, which a quantized V cache needs)."""
    cache = ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"] if cache_type else []
    out = subprocess.run([os.path.join(bin_dir, "llama-perplexity"), "-m", model, "-f", path,
                          "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *cache],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([\d.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError((out.stdout + out.stderr)[-2000:])
    return float(found.group(1))


def llama_float32(bin_dir: str, model: str, path: str, ctx: int,
                  threads: int) -> tuple[float, float]:
    """(perplexity of llama.cpp's own float32 copy of ``model``, llama-perplexity's "Same
    top p" of ``model`` against that copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        f32, base = os.path.join(tmp, "f32.gguf"), os.path.join(tmp, "base.kld")
        subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--allow-requantize", model,
                        f32, "F32"], capture_output=True, check=True)
        common = ["-f", path, "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
                  "--kl-divergence-base", base]
        perplexity = os.path.join(bin_dir, "llama-perplexity")
        base_run = subprocess.run([perplexity, "-m", f32, *common], capture_output=True,
                                  text=True, check=True)
        out = subprocess.run([perplexity, "-m", model, *common, "--kl-divergence"],
                             capture_output=True, text=True, check=True)
    ppl = re.search(r"Final estimate: PPL = ([\d.]+)", base_run.stdout + base_run.stderr)
    found = re.search(r"Same top p:\s*([\d.]+)", out.stdout + out.stderr)
    if not found or not ppl:
        raise RuntimeError((base_run.stderr + out.stdout + out.stderr)[-2000:])
    return float(ppl.group(1)), float(found.group(1)) / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-cache-dtype", default=None, nargs="+",
                        help="also score the kept file over this KV cache dtype (int8, "
                             "fp8_e4m3, fp8_e5m2; several: each in turn), and its top-1 "
                             "agreement with the kept file's own cache")
    parser.add_argument("--hf-overrides", default=None,
                        help="loom's --hf-overrides (a context past the checkpoint's: its "
                             "scored chunks are --ctx tokens and one more is generated)")
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    args = parser.parse_args()
    overrides = {"hf_overrides": args.hf_overrides} if args.hf_overrides else {}
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = str(default_model_path())
    from loom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    body = text(args.tokens, tokenizer)
    token_ids = tokenizer.encode(body)[:args.tokens]
    bos = chunk_bos(tokenizer)
    if tokenizer.encode(tokenizer.decode(token_ids)) != token_ids:
        raise SystemExit("the text's token ids do not survive decode and encode: llama.cpp "
                         "would score other tokens")
    kept, kept_top1 = loom_perplexity(args.model, token_ids, args.ctx, bos, **overrides)
    dequantized, reference_top1 = loom_perplexity(args.model, token_ids, args.ctx, bos,
                                                  dtype="float32", quantization="none",
                                                  **overrides)
    results = {
        "loom kept (bf16)": kept,
        "loom dequantized (float32)": dequantized,
        "loom kept (bf16): top-1 agreement with loom dequantized (float32)":
            sum(a == b for a, b in zip(kept_top1, reference_top1)) / len(kept_top1),
    }
    for cache_dtype in args.kv_cache_dtype or ():
        cache, cache_top1 = loom_perplexity(args.model, token_ids, args.ctx, bos,
                                            kv_cache_dtype=cache_dtype, **overrides)
        results[f"loom kept (bf16), {cache_dtype} KV cache"] = cache
        results[f"loom kept (bf16), {cache_dtype} KV cache: top-1 agreement with "
                "the bf16 KV cache"] = \
            sum(a == b for a, b in zip(cache_top1, kept_top1)) / len(kept_top1)
        results[f"loom kept (bf16), {cache_dtype} KV cache: top-1 agreement with "
                "loom dequantized (float32)"] = \
            sum(a == b for a, b in zip(cache_top1, reference_top1)) / len(kept_top1)
    if os.path.exists(os.path.join(args.llama_bin, "llama-perplexity")):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(tokenizer.decode(token_ids))
        results["llama.cpp llama-perplexity"] = llama_perplexity(
            args.llama_bin, args.model, f.name, args.ctx, args.threads)
        if "int8" in (args.kv_cache_dtype or ()):  # loom's int8 cache is llama.cpp's q8_0
            results["llama.cpp llama-perplexity, q8_0 KV cache"] = llama_perplexity(
                args.llama_bin, args.model, f.name, args.ctx, args.threads, "q8_0")
        float32, same_top1 = llama_float32(args.llama_bin, args.model, f.name, args.ctx,
                                           args.threads)
        results["llama.cpp llama-perplexity, its float32 copy of the file"] = float32
        results["llama.cpp: top-1 agreement with its own float32 copy"] = same_top1
    else:
        print(f"no llama-perplexity in {args.llama_bin}: loom only", file=sys.stderr)
    for name, value in results.items():
        print(f"{name}: {value:.4f}")


if __name__ == "__main__":
    main()
