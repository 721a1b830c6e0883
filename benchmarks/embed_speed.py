"""Embeddings per second: loom (``LLM.embed``, ``task="embed"``) against
sentence-transformers on the same Hugging Face checkpoint, interleaved, one process each
round, with every process's peak resident memory.

    python benchmarks/embed_speed.py --model /work/bench-envs/models/smollm2-135m-bf16 \\
        [--texts 256] [--rounds 3] [--dtype bfloat16] [--result-file results/embed.json]
    python benchmarks/embed_speed.py --make-bert /tmp/bert-base   # then:
    python benchmarks/embed_speed.py --model /tmp/bert-base --st-modules --dtype float32

The texts are 256 short sentences (8-40 words, ~10-60 tokens). Both pool the last
token and normalize (a decoder checkpoint without sentence-transformers files: what
loom does by default; sentence-transformers is told so with its own Pooling and
Normalize modules). With ``--st-modules`` both pool as the checkpoint's own
sentence-transformers files say (an encoder's: ``--make-bert DIR`` writes a random
BERT-base-shaped one, 12 layers of 768, CLS pooling, normalized). Each side runs its own
process per round, alternately; the figure is the embedding of all texts once warm (a
first pass over 16 texts before timing). Checks that both give the same vectors (cosine).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time

from fresh_process import run_in_child

WORDS = ("the of and a to in is you that it he was for on are as with his they at be this "
         "from have or by one had not but what all were when we there can an your which "
         "their said if do will each about how up out them then she many some so these "
         "would other into has more her two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long "
         "little very after words called just where most know").split()


def texts(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."
            for _ in range(count)]


def run_loom(model: str, count: int, dtype: str, st_modules: bool = False) -> dict:
    from loom import LLM

    items = texts(count)
    with LLM(model, task="embed", dtype=dtype, enable_warm_up=False,
             max_num_seqs=256) as llm:
        llm.embed(items[:16], use_tqdm=False)
        start = time.perf_counter()
        out = llm.embed(items, use_tqdm=False)
        seconds = time.perf_counter() - start
        import psutil

        workers = psutil.Process().children(recursive=True)  # loom's worker processes, if any
        worker_rss = sum(c.memory_info().rss for c in workers) / 2**20
    return {"seconds": seconds, "first": out[0].outputs.embedding, "worker_rss_mib": worker_rss,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_st(model: str, count: int, dtype: str, st_modules: bool = False) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer, models

    if st_modules:  # the checkpoint's own modules
        st = SentenceTransformer(model, device="cpu",
                                 model_kwargs={"dtype": getattr(torch, dtype)})
    else:
        # the text as it is (sentence-transformers would render a checkpoint's chat
        # template around it), in the dtype asked
        transformer = models.Transformer(
            model, model_kwargs={"dtype": getattr(torch, dtype)},
            modality_config={"text": {"method": "forward",
                                      "method_output_name": "last_hidden_state"}},
            module_output_name="token_embeddings")
        pooling = models.Pooling(transformer.get_word_embedding_dimension(), "lasttoken")
        st = SentenceTransformer(modules=[transformer, pooling, models.Normalize()],
                                 device="cpu")
    items = texts(count)
    st.encode(items[:16], batch_size=32)
    start = time.perf_counter()
    out = st.encode(items, batch_size=32, convert_to_numpy=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "first": out[0].astype("float64").tolist(), "worker_rss_mib": 0.0,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def make_bert(path: str) -> None:
    """A random BERT-base-shaped sentence-transformers checkpoint (CLS pooling,
    normalized) with the tests' WordPiece tokenizer (words it lacks are [UNK]: one token
    each, as a real vocabulary's common words are)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from encoder_fixtures import make_embedding_model

    make_embedding_model(path, "bert", "cls", hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, intermediate_size=3072,
                         max_position_embeddings=512, vocab_size=30522)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face checkpoint directory")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--st-modules", action="store_true",
                        help="both pool as the checkpoint's sentence-transformers files say")
    parser.add_argument("--make-bert", metavar="DIR",
                        help="write a random BERT-base-shaped sentence-transformers "
                             "checkpoint to DIR and exit")
    args = parser.parse_args()
    if args.make_bert:
        make_bert(args.make_bert)
        return
    if not args.model:
        parser.error("--model is required (or --make-bert DIR)")
    rounds = {"loom": [], "sentence-transformers": []}
    rss = {"loom": [], "sentence-transformers": []}
    first = {}
    for index in range(args.rounds):
        for name, which in (("loom", "loom"), ("sentence-transformers", "st")):
            # one side in a fresh process: its figures, its own peak RSS and, for loom,
            # its worker processes' RSS at the end
            result = run_in_child("embed_speed", f"run_{which}", args.model, args.texts,
                                  args.dtype, args.st_modules)
            rounds[name].append(args.texts / result["seconds"])
            rss[name].append({"process_peak": round(result["peak_rss_mib"]),
                              "workers_at_end": round(result["worker_rss_mib"])})
            first[name] = result["first"]
            print(f"round {index + 1} {name}: {rounds[name][-1]:.1f} embeddings/s, "
                  f"RSS {rss[name][-1]} MiB", file=sys.stderr)
    a, b = first["loom"], first["sentence-transformers"]
    cosine = sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) * sum(y * y for y in b)) ** .5
    ratios = [x / y for x, y in zip(rounds["loom"], rounds["sentence-transformers"])]
    summary = {
        "command": "python benchmarks/embed_speed.py " + " ".join(sys.argv[1:]),
        "model": args.model, "dtype": args.dtype, "texts": args.texts,
        "embeddings_per_s": rounds, "peak_rss_mib": rss,
        "median_ratio_loom_over_st": round(statistics.median(ratios), 3),
        "cosine_first_text": round(cosine, 6)}
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
