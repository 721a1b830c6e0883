"""MoBA against full attention on the CPU: one attention layer over a paged cache holding
8k, 16k and 32k tokens of context, a decode step and a prefill chunk, interleaved.

    python benchmarks/moba.py                         # SmolLM2-135M's heads, bf16
    python benchmarks/moba.py --heads 32 --kv-heads 8 # Llama-3.2-1B's
    python benchmarks/moba.py --dtype float32 --paths full,moba,moba-torch

Paths, each an attention layer's whole forward (writing the step's K/V included):

- ``full``: loom's ``cpu`` backend (its native paged attention kernel; in float32 a
  chunk over 256 tokens runs SDPA);
- ``moba``: ``MobaAttention`` over the same backend: the block means update and
  ``moba_attention`` (loom/kernels/csrc/moba.cpp);
- ``moba-torch``: ``MobaAttention`` over the ``torch`` backend, its PyTorch path
  (gathers of each query's chosen blocks; no query x context scores).

Every case builds its cache once (random K/V, shuffled blocks, every block's mean), then
runs the paths in turn, ``--rounds`` times, the order rotating each round, so each path
sees the same phases of a shared host. Reported: min and median milliseconds per
forward, and each path's median over ``full``'s. The new tokens sit past the context
(positions ctx .. ctx + n - 1; a decode writes no MoBA block's last key). Results:
``--out`` (JSON), a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loom.config import MobaAttentionConfig  # noqa: E402
from loom.kernels import native_ops  # noqa: E402
from loom.model.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from loom.model.attention.metadata import AttentionMetadata  # noqa: E402
from loom.model.attention.moba import MobaAttention, update_block_means  # noqa: E402
from loom.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

CACHE_BLOCK = 16


def metadata_for(tables: list[list[int]], first: int, new: int) -> AttentionMetadata:
    """A step of ``len(tables)`` requests, each with ``new`` tokens at ``first`` ..."""
    slots, starts, lens = [], [0], []
    for table in tables:
        slots += [table[p // CACHE_BLOCK] * CACHE_BLOCK + p % CACHE_BLOCK
                  for p in range(first, first + new)]
        starts.append(starts[-1] + new)
        lens.append(first + new)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32), query_start_loc_cpu=starts,
        seq_lens_cpu=lens, max_query_len=new, max_seq_len=first + new, block_size=CACHE_BLOCK)


def run_case(args, dtype: torch.dtype, context: int, new: int, batch: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    scale = head_dim ** -0.5
    config = MobaAttentionConfig(args.block, args.topk, args.min_seq_len)
    per_request = (context + new + CACHE_BLOCK - 1) // CACHE_BLOCK
    num_blocks = batch * per_request + 1
    order = list(range(1, num_blocks))
    random.Random(0).shuffle(order)
    tables = [order[i * per_request:(i + 1) * per_request] for i in range(batch)]
    kv_cache = torch.empty(CpuAttentionBackend(heads, kv_heads, head_dim, scale)
                           .kv_cache_shape(num_blocks, CACHE_BLOCK), dtype=dtype)
    # the context: random keys and values written in pieces, then every block's mean
    for lo in range(0, context, 4096):
        n = min(4096, context - lo)
        meta = metadata_for(tables, lo, n)
        rows = batch * n
        TorchAttentionBackend._write_kv(torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype),
                                        torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype),
                                        kv_cache, meta.slot_mapping)
    meta = metadata_for(tables, 0, context)
    means = torch.zeros(kv_heads, num_blocks, head_dim)
    update_block_means(means, kv_cache, meta, args.block)
    step = metadata_for(tables, context, new)
    q = torch.randn(batch * new, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch * new, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch * new, kv_heads, head_dim, generator=gen).to(dtype)
    full = CpuAttentionBackend(heads, kv_heads, head_dim, scale)
    paths = {}
    for name in args.paths:
        if name == "full":
            paths[name] = full
        else:
            backend = full if name == "moba" else TorchAttentionBackend(heads, kv_heads,
                                                                       head_dim, scale)
            moba = MobaAttention(config, backend)
            moba.block_means = means
            paths[name] = moba
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    with torch.inference_mode():
        for name in names:  # once each, untimed
            paths[name].forward(q, k, v, kv_cache, step)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                paths[name].forward(q, k, v, kv_cache, step)
                times[name].append(time.perf_counter() - start)
    result = {"dtype": str(dtype).removeprefix("torch."), "context": context, "new": new,
              "batch": batch, "ms": {}}
    base = statistics.median(times["full"]) if "full" in times else None
    for name, ts in times.items():
        median = statistics.median(ts)
        result["ms"][name] = {"min": min(ts) * 1e3, "median": median * 1e3,
                              "x_full": None if base is None else base / median}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--contexts", default="8192,16384,32768")
    parser.add_argument("--block", type=int, default=512, help="moba_block_size")
    parser.add_argument("--topk", type=int, default=3, help="moba_topk")
    parser.add_argument("--min-seq-len", type=int, default=0, help="moba_min_seq_len")
    parser.add_argument("--chunk", type=int, default=256, help="new tokens of the prefill chunk")
    parser.add_argument("--batch", type=int, default=1, help="decode requests in a step")
    parser.add_argument("--paths", default="full,moba,moba-torch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    args.paths = args.paths.split(",")
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as a worker process does: freed temporaries reused, not faulted
    if native_ops() is None and ({"full", "moba"} & set(args.paths)):
        sys.exit("loom's CPU kernels did not build: the full and moba paths need them")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results = []
    print(f"{args.heads} heads, {args.kv_heads} KV heads of {args.head_dim}, {args.dtype}; "
          f"MoBA blocks of {args.block}, top {args.topk}; {torch.get_num_threads()} threads")
    print(f"{'case':>28} | " + " | ".join(f"{name:>22}" for name in args.paths))
    for context in map(int, args.contexts.split(",")):
        for new, batch, label in ((1, args.batch, "decode"), (args.chunk, 1, "chunk")):
            result = run_case(args, dtype, context, new, batch)
            results.append(result)
            cells = [f"{m['median']:8.2f} ms" + (f" ({m['x_full']:5.1f}x)"
                                                  if m["x_full"] else "")
                     for m in result["ms"].values()]
            case = f"{label} {new}x{batch} @ {context:,}"
            print(f"{case:>28} | " + " | ".join(f"{c:>22}" for c in cells), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "args": vars(args), "host": platform.node(), "cpu": platform.processor(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
