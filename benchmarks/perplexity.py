"""Perplexity of one GGUF file: loom (kept quantized, and dequantized in float32) beside
llama.cpp's ``llama-perplexity`` on the same file and text, by llama-perplexity's method.

    python benchmarks/perplexity.py                       # the default Q4_1 file
    python benchmarks/perplexity.py --model F.gguf --ctx 512 --llama-bin DIR

The text ships offline: Python standard library docstrings (tests/model/
test_quantization.py's, repeated to ``--tokens``). llama-perplexity splits the tokens
into chunks of ``--ctx``, puts BOS first in each chunk, and scores each chunk's second
half given everything before it in the chunk; loom is scored the same way, on the same
token ids (llama.cpp's tokenizer is given the text; loom's tokens are checked to be the
same count). llama.cpp comes from benchmarks/setup_baselines.sh; a benchmark tool only.
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


def loom_perplexity(model: str, token_ids: list[int], ctx: int, bos: int, **kwargs) -> float:
    from loom import LLM, SamplingParams

    llm = LLM(model, max_model_len=ctx + 8, enable_warm_up=False, **kwargs)
    nll, count = 0.0, 0
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        for start in range(0, len(token_ids) - ctx + 1, ctx):
            chunk = [bos] + token_ids[start + 1:start + ctx]
            out = llm.generate([{"prompt_token_ids": chunk}], params, use_tqdm=False)[0]
            for position in range(ctx // 2, ctx):
                nll -= out.prompt_logprobs[position][chunk[position]].logprob
                count += 1
    finally:
        llm.shutdown()
    return math.exp(nll / count)


def llama_perplexity(bin_dir: str, model: str, path: str, ctx: int, threads: int) -> float:
    out = subprocess.run([os.path.join(bin_dir, "llama-perplexity"), "-m", model, "-f", path,
                          "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([\d.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError((out.stdout + out.stderr)[-2000:])
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-bin", default=os.path.join(
        os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs"), "llama.cpp", "bin"))
    args = parser.parse_args()
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = str(default_model_path())
    from loom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    body = text(args.tokens, tokenizer)
    token_ids = tokenizer.encode(body)[:args.tokens]
    bos = tokenizer.hf.bos_token_id if tokenizer.hf.bos_token_id is not None else token_ids[0]
    results = {
        "loom Q4_1 kept (bf16)": loom_perplexity(args.model, token_ids, args.ctx, bos),
        "loom dequantized (float32)": loom_perplexity(args.model, token_ids, args.ctx, bos,
                                                      dtype="float32", quantization="none"),
    }
    if os.path.exists(os.path.join(args.llama_bin, "llama-perplexity")):
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(tokenizer.decode(token_ids))
        results["llama.cpp llama-perplexity"] = llama_perplexity(
            args.llama_bin, args.model, f.name, args.ctx, args.threads)
    else:
        print(f"no llama-perplexity in {args.llama_bin}: loom only", file=sys.stderr)
    for name, value in results.items():
        print(f"{name}: {value:.4f}")


if __name__ == "__main__":
    main()
