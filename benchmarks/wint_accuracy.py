"""What ``--quantization wint8|wint4`` cost on the default model: perplexity and top-1
agreement over 2,000 tokens of standard library docstrings (tests/model/
test_quantization.py's text), against the same file dequantized in float32.

    python benchmarks/wint_accuracy.py [--methods wint8 wint4]

Each method runs twice: as it ships (the embedding table and LM head quantized to wint8
with the linears) and with ``--lm-head-fp32`` (the table kept full precision, the head
in float32), so the table's share of the error shows.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"),
                os.path.join(os.path.dirname(HERE), "tests", "model")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["wint8", "wint4"])
    args = parser.parse_args()
    import numpy as np
    from model.test_quantization import prompt_top1_and_nll, stdlib_text

    from loom import LLM
    from loom.default_model import installed_model_path

    path = str(installed_model_path())
    reference = LLM(path, dtype="float32", quantization="none", max_model_len=2304,
                    enable_warm_up=False)
    token_ids = reference.get_tokenizer().encode(stdlib_text())[:2000]
    ref_top1, ref_nll = prompt_top1_and_nll(reference, token_ids)
    reference.shutdown()
    print(f"reference (the file dequantized, float32): perplexity "
          f"{math.exp(np.mean(ref_nll)):.3f}")
    for method in args.methods:
        for fp32_head in (False, True):
            llm = LLM(path, dtype="bfloat16", quantization=method, max_model_len=2304,
                      enable_warm_up=False, lm_head_fp32=fp32_head)
            top1, nll = prompt_top1_and_nll(llm, token_ids)
            llm.shutdown()
            agree = sum(a == b for a, b in zip(top1, ref_top1)) / len(top1)
            table = "table full precision, --lm-head-fp32" if fp32_head else "table wint8"
            print(f"{method} ({table}): perplexity {math.exp(np.mean(nll)):.3f}, "
                  f"top-1 agreement {agree:.4f}", flush=True)


if __name__ == "__main__":
    main()
