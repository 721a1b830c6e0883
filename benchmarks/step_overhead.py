"""Where a decode step's time goes: the model's kernels against everything around them.

Runs the engine in this process as ``loom bench latency`` does (``LLM``, one rank, the
worker in-process), decodes a batch of identical-length requests, and times each
decode step piece by piece by wrapping the engine's own methods:

    LLMEngine.step ─┬─ EngineCore.step ─┬─ Scheduler.schedule
                    │                   ├─ Executor.execute_model ─┬─ _update_states
                    │                   │                          ├─ _prepare_inputs
                    │                   │                          ├─ model forward   ┐ the
                    │                   │                          ├─ compute_logits  ┘ model
                    │                   │                          └─ _sample
                    │                   └─ Scheduler.update_from_output
                    └─ OutputProcessor.process_outputs

``host`` is a step's time minus the model's (forward + compute_logits): what Python,
the scheduler, input preparation, sampling and output processing cost per step. Each
figure is the median over the decode steps (every step after the batch's first token).
The wrappers add about a microsecond per call.

``--host-only`` replaces the model's forward and LM head by fixed tensors (the hidden
states and logits of a real step, as a greedy batch-1 decode would see them), so every
step measures the host alone, without kernels or OpenMP in the way; ``--cprofile N``
prints the N largest functions of that run by cumulative time.

    python benchmarks/step_overhead.py                          # default Q4_1 file, batch 1
    python benchmarks/step_overhead.py --quantization none      # dequantized to bf16
    python benchmarks/step_overhead.py --json                   # one JSON line
    python benchmarks/step_overhead.py --threads 1 --clock cpu  # on a busy host

Two trees A/B (the host is shared: interleave them in one run, compare ratios):

    for i in 1 2 3; do for t in /tmp/ab-old /work/main; do
      PYTHONPATH=$t flock /tmp/loom-bench.lock python benchmarks/step_overhead.py --json
    done; done
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))

# What each part is called in the report, in the order the step runs them.
PARTS = ("step", "schedule", "execute", "update_states", "prepare_inputs", "forward",
         "compute_logits", "sample", "update_from_output", "process_outputs")


class StepTimer:
    """Nanoseconds spent in each wrapped method during the current step: wall time, or
    with ``clock=time.thread_time_ns`` this thread's CPU time (what a loaded host's
    other processes do not add to; with one torch thread the kernels run on it too)."""

    def __init__(self, clock=time.perf_counter_ns) -> None:
        self.current: dict[str, int] = defaultdict(int)
        self.clock = clock

    def wrap(self, owner: object, method: str, part: str) -> None:
        inner = getattr(owner, method)
        current, clock = self.current, self.clock

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                current[part] += clock() - start

        setattr(owner, method, timed)

    def take(self) -> dict[str, int]:
        taken = dict(self.current)
        self.current.clear()
        return taken


def instrument(llm, clock) -> StepTimer:
    engine = llm.engine
    core = engine.engine_core
    runner = core.executor.worker.model_runner
    timer = StepTimer(clock)
    timer.wrap(engine, "step", "step")
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_from_output", "update_from_output")
    timer.wrap(core.executor, "execute_model", "execute")
    timer.wrap(runner, "_update_states", "update_states")
    timer.wrap(runner, "_prepare_inputs", "prepare_inputs")
    timer.wrap(runner, "_sample", "sample")
    timer.wrap(runner.model, "forward", "forward")  # nn.Module.__call__ reads self.forward
    timer.wrap(runner.model, "compute_logits", "compute_logits")
    timer.wrap(engine.output_processor, "process_outputs", "process_outputs")
    return timer


def decode_steps(llm, timer: StepTimer, prompts: list[list[int]], output_len: int,
                 tag: str) -> list[dict[str, int]]:
    """Run one batch to completion; the timings of its decode steps."""
    from loom import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    waiting_first = set()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params, stream=True)
        waiting_first.add(f"{tag}-{i}")
    steps = []
    timer.take()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        timing = timer.take()
        if waiting_first:
            waiting_first.difference_update(o.request_id for o in outputs)
        else:
            steps.append(timing)
    return steps


def replace_model(llm) -> None:
    """``--host-only``: the model's forward and compute_logits return what a real step
    returned (captured here from one), so steps cost only the host's work."""
    runner = llm.engine.engine_core.executor.worker.model_runner
    model = runner.model
    captured = {}
    forward, compute_logits = model.forward, model.compute_logits

    def capture_forward(input_ids, positions):
        captured["hidden"] = forward(input_ids, positions)
        return captured["hidden"]

    def capture_logits(hidden_states):
        captured["logits"] = compute_logits(hidden_states)
        return captured["logits"]

    model.forward, model.compute_logits = capture_forward, capture_logits
    from loom import SamplingParams

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    hidden, logits = captured["hidden"][-1:].clone(), captured["logits"].clone()

    def fixed_forward(input_ids, positions):
        return hidden.expand(input_ids.shape[0], -1)

    def fixed_logits(hidden_states):
        return logits.expand(hidden_states.shape[0], -1)

    model.forward, model.compute_logits = fixed_forward, fixed_logits


def summarize(steps: list[dict[str, int]]) -> dict[str, float]:
    """Median milliseconds of each part and of ``host`` (step minus the model)."""
    def median_ms(values) -> float:
        return statistics.median(values) / 1e6

    result = {part: median_ms([s.get(part, 0) for s in steps]) for part in PARTS}
    result["model"] = median_ms([s.get("forward", 0) + s.get("compute_logits", 0)
                                 for s in steps])
    result["host"] = median_ms([s["step"] - s.get("forward", 0) - s.get("compute_logits", 0)
                                for s in steps])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2 Q4_1)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 on a busy host")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (robust on a busy host; with "
                             "--threads 1 the kernels run on this thread)")
    parser.add_argument("--host-only", action="store_true",
                        help="fixed tensors for the model's forward and logits")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="profile the measured steps, print the top N functions")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from loom import LLM
    from loom.default_model import default_model_path
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as `loom bench latency` does at its entry
    model = args.model or default_model_path()
    llm = LLM(model, quantization=args.quantization, max_model_len=512)
    try:
        import numpy as np

        from loom.bench.datasets import PromptMaker

        maker = PromptMaker(llm.get_tokenizer(), np.random.default_rng(0))

        def batch() -> list[list[int]]:
            return [maker.make(args.input_len)[1] for _ in range(args.batch_size)]

        if args.host_only:
            replace_model(llm)
        timer = instrument(llm, time.thread_time_ns if args.clock == "cpu"
                           else time.perf_counter_ns)
        decode_steps(llm, timer, batch(), 8, "warm-up")
        profiler = None
        if args.cprofile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        steps = []
        for iteration in range(args.num_iters):
            steps += decode_steps(llm, timer, batch(), args.output_len, f"i{iteration}")
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
    finally:
        llm.shutdown()
    result = summarize(steps)
    record = {"tree": os.path.dirname(sys.modules["loom"].__file__), "model": model,
              "quantization": args.quantization, "host_only": args.host_only,
              "clock": args.clock, "threads": args.threads, "batch_size": args.batch_size,
              "decode_steps": len(steps),
              "decode_tokens_per_s": args.batch_size / (result["step"] / 1e3),
              "ms": {k: round(v, 4) for k, v in result.items()}}
    if args.json:
        print(json.dumps(record), flush=True)
        return
    print(f"{record['tree']}: {model} ({args.quantization}), batch {args.batch_size}, "
          f"{len(steps)} decode steps, {record['decode_tokens_per_s']:.1f} tok/s")
    print(f"  step {result['step']:.3f} ms = model {result['model']:.3f} "
          f"(forward {result['forward']:.3f}, compute_logits {result['compute_logits']:.3f}) "
          f"+ host {result['host']:.3f}")
    for part in PARTS[1:]:
        if part not in ("forward", "compute_logits"):
            print(f"  {part:20s} {result[part]:.3f} ms")


if __name__ == "__main__":
    main()
