"""Batch invariance on the 1B-class checkpoint, every kept format: 16 prompts decoded
alone equal the same prompts inside batches of 2, 9, 17 and 33 mixed prompts, chunked,
after a prefix hit, and with preemption (tests/e2e/test_batch_invariance.py's check, on
weights too large for CI).

    python benchmarks/batch_invariance.py [--models /work/bench-envs/models] [--out FILE]

Runs ``check_invariance`` for the GGUF files of ``benchmarks/make_1b.py`` kept in their
formats (Q4_0, Q4_1, Q8_0, Q4_K_M) and for its checkpoint in bf16, wint8 and wint4, on the
kernels this CPU takes, and writes which passed (and the first mismatch of any that did
not) as JSON. A few minutes per format on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "model"),
                os.path.join(ROOT, "tests", "e2e")]

ENVS = os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs")
KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M")
PLAIN = (("bf16", "none"), ("wint8", "wint8"), ("wint4", "wint4"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=os.path.join(ENVS, "models"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "batch_invariance_1b.json"))
    parser.add_argument("--only", nargs="*", default=None,
                        help="case names to run (Q4_0 ... Q4_K_M, bf16, wint8, wint4); default all")
    args = parser.parse_args()

    from test_batch_invariance import check_invariance

    from loom.kernels import native_ops

    checkpoint = os.path.join(args.models, "llama-1b-random")
    cases = [(f"GGUF {kind}", os.path.join(args.models, f"llama-1b-random-{kind.lower()}.gguf"), {})
             for kind in KINDS]
    cases += [(name, checkpoint, {"quantization": quantization}) for name, quantization in PLAIN]
    if args.only:
        cases = [case for case in cases if case[0].removeprefix("GGUF ") in args.only]
    ops = native_ops()
    results = {"command": "python benchmarks/batch_invariance.py", "isa": ops.isa() if ops else None,
               "cases": {}}
    for name, path, kwargs in cases:
        started = time.monotonic()
        try:
            check_invariance(path, 49152, **kwargs)
            outcome = "equal"
        except AssertionError as error:
            outcome = f"differs: {str(error).splitlines()[0]}"
        results["cases"][name] = {"outcome": outcome, "seconds": round(time.monotonic() - started, 1)}
        print(name, results["cases"][name], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
