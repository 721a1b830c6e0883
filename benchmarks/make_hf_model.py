"""Write the default model (SmolLM2-135M-Instruct, GGUF Q4_1) as a bf16 Hugging Face directory.

vLLM's CPU build cannot run the Q4_1 GGUF, so every engine in ``run_all`` loads this
directory instead: the Q4_1 weights dequantized once by ``transformers`` and stored in
bf16, with the GGUF's tokenizer and chat template. Same weights for everyone.

    python benchmarks/make_hf_model.py /work/bench-envs/models/smollm2-135m-bf16
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loom.default_model import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the default model)")
    args = parser.parse_args()
    gguf = args.gguf or default_model_path()
    if os.path.exists(os.path.join(args.out_dir, "config.json")):
        print(f"{args.out_dir} exists; nothing to do")
        return
    start = time.perf_counter()
    folder, name = os.path.split(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A model loaded from GGUF refuses save_pretrained; copy its (dequantized) weights
    # into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
