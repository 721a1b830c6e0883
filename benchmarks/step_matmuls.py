"""A decode step against its own matmuls: what the rest of a step costs at batch 1.

    python benchmarks/step_matmuls.py --model F.gguf            # the file's formats kept
    python benchmarks/step_matmuls.py --model F.gguf --rounds 20

Loads the model with ``LLM`` (one rank, in this process), then alternates, ``--rounds``
times: every linear layer's matmul and the LM head's, one row each, back to back on the
layers' own weights (``quantized_linear`` or ``bf16_linear``, three passes, median), and
a short greedy decode (``--tokens`` steps after a 64-token prompt, median step through
``LLMEngine.step``). The difference is what a step costs beyond streaming its weights:
attention, norms, rotary, activations, the kernels' parallel regions, and the
host's scheduling, input preparation, sampling and output processing
(``benchmarks/step_overhead.py`` splits out the host's share). Alternating within
seconds, so both halves of a round meet the same memory phase on a host whose speed
drifts; the median difference over rounds is the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def matmul_jobs(model, ops) -> list:
    """(call, out, x, weight) for every linear layer and the LM head, one row each."""
    from loom.model.layers.linear import LinearBase
    from loom.model.layers.weight_forms import Bf16Panels, MixedFormats, QuantizedKernel

    jobs = []

    def add(call, weight, n: int, k: int, dtype: torch.dtype) -> None:
        jobs.append((call, torch.empty(1, n, dtype=dtype), torch.randn(1, k).bfloat16(), weight))

    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        form = module.form
        if isinstance(form, QuantizedKernel):
            w = form.weight
            add(ops.quantized_linear, w, w.out_features, w.in_features, torch.bfloat16)
        elif isinstance(form, Bf16Panels):
            w = form.packed
            add(ops.bf16_linear, w.data, w.out_features, 2 * w.data.shape[1], torch.bfloat16)
        elif isinstance(form, MixedFormats) and form.on_kernel:
            for part in form.parts:  # a fused layer in several formats: one per part
                w = part.weight
                add(ops.quantized_linear, w, w.out_features, w.in_features, torch.bfloat16)
        else:
            raise SystemExit(f"{type(module).__name__} is on neither native kernel: "
                             "this measures loom's CPU kernels only")
    head = model.lm_head
    if isinstance(head.table, QuantizedKernel):
        w = head.table.weight
        add(ops.quantized_linear, w, w.out_features, w.in_features, torch.float32)
    elif head.panels is not None:
        w = head.panels.packed
        add(ops.bf16_linear, w.data, w.out_features, 2 * w.data.shape[1], torch.float32)
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or checkpoint (default: "
                                                      "the default model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = str(default_model_path())
    import loom.kernels
    from loom import LLM
    from loom.bench.offline import _time_batch
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as `loom bench latency` and the served engine's process do
    ops = loom.kernels.native_ops()
    llm = LLM(args.model, quantization=args.quantization, max_model_len=512,
              distributed_executor_backend="uni")
    try:
        model = llm.engine.engine_core.executor.worker.model_runner.model
        jobs = matmul_jobs(model, ops)
        vocab = llm.get_tokenizer().vocab_size
        rows = []
        for r in range(args.rounds):
            passes = []
            for _ in range(3):
                start = time.perf_counter()
                for call, out, x, weight in jobs:
                    call(out, x, weight, None)
                passes.append(time.perf_counter() - start)
            prompt = [(r * 7919 + i * 104729) % (vocab - 200) + 100 for i in range(64)]
            _, steps, _ = _time_batch(llm.engine, [prompt], args.tokens + 1, f"r{r}")
            row = (statistics.median(passes), statistics.median(steps))
            rows.append(row)
            print(f"round {r}: matmuls {row[0] * 1e3:.2f} ms, decode step {row[1] * 1e3:.2f} "
                  f"ms, rest {(row[1] - row[0]) * 1e3:.2f} ms", flush=True)
    finally:
        llm.shutdown()
    print(f"{args.model} ({args.quantization}), {len(jobs)} matmuls a step: median matmuls "
          f"{statistics.median(m for m, _ in rows) * 1e3:.2f} ms, step "
          f"{statistics.median(s for _, s in rows) * 1e3:.2f} ms, rest "
          f"{statistics.median(s - m for m, s in rows) * 1e3:.2f} ms (median of differences)")


if __name__ == "__main__":
    main()
