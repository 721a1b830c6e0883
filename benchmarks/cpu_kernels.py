"""Micro-benchmarks behind loom's CPU fast paths (loom/kernels, loom/model/layers/linear.py).

Three tables, each A/B interleaved in one process (min and median of --iters runs):

1. weight matmuls of SmolLM2-135M's 30 layers (212 MB of bf16 weights, more than the
   L3, so weights stream from memory as in a real step) at 1-256 rows: F.linear,
   ATen GEMV (one row), oneDNN on pre-packed weights, loom's bf16_linear (AVX512-BF16);
2. paged attention: loom's kernel against the torch backend (gather + matmuls, or
   SDPA for prefill) for decode batches, a prefill and a long chunk;
3. a whole model step (profile_step.PagedBatch) with the native kernels on and off.

    python benchmarks/cpu_kernels.py                 # all three
    python benchmarks/cpu_kernels.py --only matmul   # one table

On a loaded machine set OMP_WAIT_POLICY=PASSIVE; the min is the steadier figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import loom.kernels  # noqa: E402
from loom.model.attention.metadata import AttentionMetadata  # noqa: E402
from loom.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def timed(fn, iters: int) -> list[float]:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def fmt(times: list[float]) -> str:
    return f"{min(times) * 1e3:7.2f} / {statistics.median(times) * 1e3:7.2f}"


def matmul_table(iters: int) -> None:
    torch.manual_seed(0)
    ops = loom.kernels.native_ops()
    mine = ops is not None and ops.bf16_gemm_available()
    layers = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES] for _ in range(30)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in layers]
    panels = [[ops.pack_bf16_weight(w) for w in layer] for layer in layers] if mine else None
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer)
    print(f"\n## 30 layers' weight matmuls ({nbytes / 1e6:.0f} MB bf16), ms min / median")
    print("| rows | F.linear | ATen GEMV | oneDNN packed | loom bf16_linear |")
    print("|---|---|---|---|---|")

    def run(kind: str, x: dict[int, torch.Tensor]):
        outs = {n: torch.empty(x[576].shape[0], n, dtype=torch.bfloat16) for n, _ in SHAPES}

        def step():
            for i, (layer, layer_packed) in enumerate(zip(layers, packed)):
                for j, (w, p) in enumerate(zip(layer, layer_packed)):
                    xi = x[w.shape[1]]
                    if kind == "plain":
                        F.linear(xi, w)
                    elif kind == "gemv":
                        torch._C._set_mkldnn_enabled(False)
                        F.linear(xi, w)
                        torch._C._set_mkldnn_enabled(True)
                    elif kind == "loom":
                        ops.bf16_linear(outs[w.shape[0]], xi, panels[i][j])
                    else:
                        torch.ops.mkldnn._linear_pointwise(xi, p, None, "none", [], "")
        return step

    for rows in (1, 2, 4, 8, 32, 64, 128, 256):
        x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
        kinds = ["plain", "packed"] + (["gemv"] if rows == 1 else []) + (["loom"] if mine else [])
        results = {kind: [] for kind in kinds}
        for _ in range(iters):  # interleaved
            for kind in kinds:
                results[kind] += timed(run(kind, x), 1)
        cell = {k: fmt(v) for k, v in results.items()}
        print(f"| {rows} | {cell['plain']} | {cell.get('gemv', '–')} | {cell['packed']} | "
              f"{cell.get('loom', '–')} |")


SMOLLM2_HEADS = (9, 3, 64)  # query heads, KV heads, head_dim
BLOCK_SIZE = 16


def paged_case(context_lens: list[int], query_lens: list[int]):
    """SmolLM2's heads over a shuffled bf16 block pool holding every context: (cache,
    metadata, q, k, v) of one step, q/k/v views of one qkv row as the model has them."""
    heads, kv_heads, head_dim = SMOLLM2_HEADS
    block_size = BLOCK_SIZE
    rng = random.Random(0)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, dtype=torch.bfloat16)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, starts = [], [], [0]
    for ctx, q in zip(context_lens, query_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - q, ctx)]
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=context_lens, max_query_len=max(query_lens),
        max_seq_len=max(context_lens), block_size=block_size)
    tokens = starts[-1]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    return cache, metadata, q, k, v


def attention_table(iters: int) -> None:
    ops = loom.kernels.native_ops()
    heads, kv_heads, head_dim = SMOLLM2_HEADS
    print("\n## paged attention, one layer (SmolLM2 heads), us min / median")
    print("| case | torch backend | loom kernel |")
    print("|---|---|---|")
    cases = [("decode b=1 ctx 192", [192], [1]), ("decode b=8 ctx 192", [192] * 8, [1] * 8),
             ("decode b=32 ctx 192", [192] * 32, [1] * 32), ("prefill 128", [128], [128]),
             ("chunk 256 over 1000", [1000], [256]), ("verify 4 x b=8", [192] * 8, [5] * 8)]
    for name, context_lens, query_lens in cases:
        cache, metadata, q, k, v = paged_case(context_lens, query_lens)
        tokens = q.shape[0]
        backend = TorchAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5)
        out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16)

        def reference():
            metadata._derived.clear()
            backend.forward(q, k, v, cache, metadata)

        def native():
            ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
            ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                                metadata.query_start_loc, head_dim ** -0.5, 1 << 30)
        ref_t, nat_t = [], []
        for _ in range(iters * 5):
            ref_t += timed(reference, 1)
            nat_t += timed(native, 1)
        us = lambda t: f"{min(t) * 1e6:7.0f} / {statistics.median(t) * 1e6:7.0f}"  # noqa: E731
        print(f"| {name} | {us(ref_t)} | {us(nat_t)} |")


def step_table(iters: int) -> None:
    import profile_step as ps

    from loom.default_model import default_model_path

    model, _ = ps.build_model(default_model_path(), torch.bfloat16)
    native = loom.kernels.native_ops()
    batch = ps.PagedBatch(model, num_blocks=32 * 14 + 16, block_size=16, dtype=torch.bfloat16)
    replay = model.kernel_replay  # on: the forward replayed (kernel_replay.py); off: eager
    forwards = {True: replay, False: replay.forward}
    print("\n## model step (SmolLM2-135M bf16, ctx 192), ms min / median")
    print("| step | torch ops | native kernels |")
    print("|---|---|---|")
    for name, ctx, q in [("decode b=1", [192], [1]), ("decode b=8", [192] * 8, [1] * 8),
                         ("decode b=32", [192] * 32, [1] * 32), ("prefill 128", [128], [128])]:
        inputs = batch.step_inputs(ctx, q)
        times = {False: [], True: []}
        with torch.inference_mode():
            model.forward = replay
            for _ in range(2):  # the shape's second sighting records it
                ps.run_step(model, inputs)
            for _ in range(iters):
                for on in (False, True):
                    loom.kernels._module = native if on else None
                    model.forward = forwards[on]
                    times[on] += timed(lambda: ps.run_step(model, inputs), 1)
        loom.kernels._module = native
        print(f"| {name} | {fmt(times[False])} | {fmt(times[True])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["matmul", "attention", "step"])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    for name, table in [("matmul", matmul_table), ("attention", attention_table),
                        ("step", step_table)]:
        if args.only in (None, name):
            table(args.iters)


if __name__ == "__main__":
    main()
