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

The roofline beside it: the batch's matmul work (2 x the layers' linear weights per
token, plus attention's scores and sums over each text) against torch's matmul rate in
the run's dtype, measured before every round on one layer's MLP shape. Each side's share
of that rate says how far any engine could go: an engine at share s is at most 1/s
behind the machine. Each round also records the share of the CPU other processes took.
"""

from __future__ import annotations

import argparse
import json
import os
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


def layer_shapes(model: str) -> dict:
    """Per token: the linear weights every layer multiplies by, from config.json."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    encoder = c.get("model_type") in ("bert", "roberta", "xlm-roberta", "electra",
                                      "modernbert")
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = (2 if encoder and c.get("model_type") != "modernbert" else 3) * hidden * inter
    return {"linear_params_per_token": layers * (attention + mlp), "layers": layers,
            "attention_width": heads * head_dim, "hidden": hidden, "intermediate": inter,
            "causal": not encoder}


def batch_gflop(model: str, count: int) -> tuple[float, int]:
    """The matmul work of embedding ``texts(count)`` once, and its token count (the
    checkpoint's tokenizer with its special tokens, as both engines run it)."""
    from transformers import AutoTokenizer

    shapes = layer_shapes(model)
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model)(texts(count))["input_ids"]]
    linear = 2 * shapes["linear_params_per_token"] * sum(lengths)
    # q.k and p.v: 2 x 2 x width per (query, key) pair; a causal text has n(n+1)/2 pairs
    pairs = sum(n * (n + 1) // 2 if shapes["causal"] else n * n for n in lengths)
    attention = 4 * shapes["layers"] * shapes["attention_width"] * pairs
    return (linear + attention) / 1e9, sum(lengths)


def matmul_gflop_s(model: str, dtype: str) -> float:
    """torch's rate on one layer's up projection for 512 tokens, best of 5."""
    import torch

    shapes = layer_shapes(model)
    a = torch.randn(512, shapes["hidden"], dtype=getattr(torch, dtype))
    b = torch.randn(shapes["hidden"], shapes["intermediate"], dtype=getattr(torch, dtype))
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best / 1e9


def busy_cpu_s() -> tuple[float, float, float]:
    """Now, the machine's busy CPU seconds, and this process's and its reaped children's."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick
    ours = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) \
        + sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    return time.monotonic(), busy, ours


def others_share(start: tuple, end: tuple) -> float:
    """The share of the machine's CPU taken by processes other than these."""
    wall, busy, ours = (b - a for a, b in zip(start, end))
    return round(max(0.0, busy - ours) / (wall * os.cpu_count()), 3)


def make_bert(path: str) -> None:
    """A random BERT-base-shaped sentence-transformers checkpoint (CLS pooling,
    normalized) with the tests' WordPiece tokenizer (words it lacks are [UNK]: one token
    each, as a real vocabulary's common words are)."""
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
    others = {"loom": [], "sentence-transformers": []}
    first = {}
    gflop, tokens = batch_gflop(args.model, args.texts)
    matmul = []
    for index in range(args.rounds):
        matmul.append(round(matmul_gflop_s(args.model, args.dtype), 1))
        for name, which in (("loom", "loom"), ("sentence-transformers", "st")):
            before = busy_cpu_s()
            # one side in a fresh process: its figures, its own peak RSS and, for loom,
            # its worker processes' RSS at the end
            result = run_in_child("embed_speed", f"run_{which}", args.model, args.texts,
                                  args.dtype, args.st_modules)
            others[name].append(others_share(before, busy_cpu_s()))
            rounds[name].append(args.texts / result["seconds"])
            rss[name].append({"process_peak": round(result["peak_rss_mib"]),
                              "workers_at_end": round(result["worker_rss_mib"])})
            first[name] = result["first"]
            print(f"round {index + 1} {name}: {rounds[name][-1]:.1f} embeddings/s, "
                  f"RSS {rss[name][-1]} MiB, others took {others[name][-1]:.0%} of the CPU",
                  file=sys.stderr)
    a, b = first["loom"], first["sentence-transformers"]
    cosine = sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) * sum(y * y for y in b)) ** .5
    ratios = [x / y for x, y in zip(rounds["loom"], rounds["sentence-transformers"])]
    rate = statistics.median(matmul)
    shares = {name: round(statistics.median(rounds[name]) / args.texts * gflop / rate, 3)
              for name in rounds}
    summary = {
        "command": "python benchmarks/embed_speed.py " + " ".join(sys.argv[1:]),
        "model": args.model, "dtype": args.dtype, "texts": args.texts,
        "embeddings_per_s": rounds, "peak_rss_mib": rss,
        "median_ratio_loom_over_st": round(statistics.median(ratios), 3),
        "cosine_first_text": round(cosine, 6),
        "others_cpu_share": others,
        "roofline": {"batch_tokens": tokens, "batch_gflop": round(gflop, 1),
                     f"{args.dtype}_matmul_gflop_s": matmul,
                     "share_of_matmul_rate": shares,
                     "most_any_engine_gains_over_st": round(
                         1 / shares["sentence-transformers"], 2)}}
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
