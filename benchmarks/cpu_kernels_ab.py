"""Two builds of loom's CPU kernels A/B in one process, interleaved call by call.

On a loaded machine the load moves between runs of benchmarks/cpu_kernels.py by more
than a kernel change does; here each iteration times build A and build B on the same
inputs, one right after the other (A first in even iterations, B in odd ones), so both
see the same load. Build A is another csrc/ directory (an older checkout's
``loom/kernels/csrc``), built as loom builds it; build B is this checkout's.

    git archive <commit> loom/kernels/csrc | tar -x -C /tmp/old
    OMP_NUM_THREADS=1 python benchmarks/cpu_kernels_ab.py /tmp/old/loom/kernels/csrc

Prints, per case, the median and min of each build's times and the median of the
per-iteration ratios B / A (1.00: the same speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import loom.kernels  # noqa: E402
from cpu_kernels import paged_case  # noqa: E402  (benchmarks/, on sys.path above)
from loom.model.kernel_replay import KernelReplay  # noqa: E402


def load_build(csrc: Path):
    """The module built from ``csrc`` as loom builds it. Loaded first: torch's loader
    then names this checkout's build ``loom_cpu_ops_v1``, and both stay loaded."""
    checkout = loom.kernels._CSRC
    loom.kernels._CSRC = csrc
    try:
        module = loom.kernels._load()
    finally:
        loom.kernels._CSRC = checkout
    assert module is not None, f"the kernels in {csrc} did not build"
    return module


def attention_cases():
    cases = []
    for name, context_lens, query_lens in [
            ("attention decode b=1 ctx 192", [192], [1]),
            ("attention decode b=32 ctx 192", [192] * 32, [1] * 32),
            ("attention prefill 128", [128], [128]),
            ("attention chunk 256 over 1000", [1000], [256])]:
        cache, metadata, q, k, v = paged_case(context_lens, query_lens)
        out = torch.empty(q.shape, dtype=q.dtype)

        def prepare(ops, cache=cache, metadata=metadata, q=q, k=k, v=v, out=out):
            def run():
                ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
                ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                                    metadata.query_start_loc, 0.125, 1 << 30)
            return run
        cases.append((name, prepare))
    return cases


def small_op_cases():
    torch.manual_seed(0)
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    w = torch.randn(576, dtype=torch.bfloat16)
    residual = torch.randn(32, 576, dtype=torch.bfloat16)
    gate_up = torch.randn(32, 2 * 1536, dtype=torch.bfloat16)
    qk = torch.randn(32, 12, 64, dtype=torch.bfloat16)
    positions = torch.arange(32) + 100
    cos_sin = torch.randn(2, 2048, 32)
    return [
        ("rms_norm 32x576", lambda ops: lambda: ops.rms_norm(x, w, 1e-5)),
        ("fused_add_rms_norm 32x576",
         lambda ops: lambda: ops.fused_add_rms_norm(x, residual, w, 1e-5)),
        ("silu_and_mul 32x1536", lambda ops: lambda: ops.silu_and_mul(gate_up)),
        ("rotary 32x12x64", lambda ops: lambda: ops.rotary_embedding(qk, positions, cos_sin)),
    ]


def step_cases(builds: dict):
    """A whole SmolLM2 step, its forward replayed from the kernels
    (loom/model/kernel_replay.py): a recording calls the build it was made with, so one
    replay per build, swapped in."""
    import profile_step as ps  # type: ignore[import-not-found]

    from loom.default_model import default_model_path

    model, _ = ps.build_model(default_model_path(), torch.bfloat16)
    batch = ps.PagedBatch(model, num_blocks=32 * 14 + 16, block_size=16, dtype=torch.bfloat16)
    eager = model.kernel_replay.forward
    plans = {id(ops): KernelReplay(eager, model) for ops in builds.values()}
    cases = []
    for name, ctx, q in [("step decode b=1", [192], [1]),
                         ("step decode b=32", [192] * 32, [1] * 32),
                         ("step prefill 128", [128], [128])]:
        inputs = batch.step_inputs(ctx, q)

        def prepare(ops, inputs=inputs):
            loom.kernels._module = ops
            model.forward = plans[id(ops)]
            with torch.inference_mode():  # the shape's second sighting records it
                for _ in range(2):
                    ps.run_step(model, inputs)
            assert plans[id(ops)].refusal is None

            def run():
                with torch.inference_mode():
                    ps.run_step(model, inputs)
            return run
        cases.append((name, prepare))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csrc_a", type=Path, help="build A's csrc/ directory")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    builds = {"A": load_build(args.csrc_a.resolve()), "B": loom.kernels.native_ops()}
    assert builds["B"] is not None and builds["B"].__file__ != builds["A"].__file__, \
        "build A's sources are this checkout's: nothing to compare"
    print(f"A: {args.csrc_a}\nB: {loom.kernels._CSRC}\nthreads {torch.get_num_threads()}")
    print("\n| case | A median (min) | B median (min) | B / A, median of per-iteration ratios |")
    print("|---|---|---|---|")
    for name, prepare in small_op_cases() + attention_cases() + step_cases(builds):
        times: dict[str, list[float]] = {"A": [], "B": []}
        for build in builds.values():
            prepare(build)()  # warm
        for i in range(args.iters):
            for label in ("A", "B") if i % 2 == 0 else ("B", "A"):  # neither always first
                build = builds[label]
                run = prepare(build)
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
        ratio = statistics.median(b / a for a, b in zip(times["A"], times["B"]))
        cell = {label: f"{statistics.median(t) * 1e6:.0f} ({min(t) * 1e6:.0f}) us"
                for label, t in times.items()}
        print(f"| {name} | {cell['A']} | {cell['B']} | {ratio:.2f} |", flush=True)
    loom.kernels._module = builds["B"]


if __name__ == "__main__":
    main()
