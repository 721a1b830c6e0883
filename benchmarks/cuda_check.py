"""One prepared run for a lent CUDA GPU: does loom's CUDA path hold, and how fast is it.

    python benchmarks/cuda_check.py [--out benchmarks/results/cuda_check.json]

Nothing here has run on a GPU yet (no task so far was lent one). Each check prints one
line, PASS or FAIL with the reason, and goes on; the exit status is the number that
failed. Within about 10 minutes on one GPU:

1. tokens: a tiny random Llama (and Qwen3-MoE) in float32, greedy, batched, mixed
   lengths, prefix caching on: the same tokens on ``cuda`` as on ``cpu``;
2. the default model (SmolLM2-135M Q4_1, ``--quantization none`` and ``auto``: the
   quantized path is the PyTorch reference on CUDA) in bf16 says Paris;
3. weight updates through CUDA IPC handles: ``examples/rl_weight_sync.py --device cuda``
   (a trainer process publishes GPU tensors, the engine copies device to device);
4. speed: ``loom bench latency`` on the default model, batch 1 and 32, bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

PROMPTS = [[5, 9, 13], [5, 9, 13, 21, 34, 8, 2, 17], list(range(3, 60)), [5, 9, 13, 21, 40]]


def greedy_tokens(model: str, device: str) -> list[list[int]]:
    from loom import LLM, SamplingParams

    with LLM(model, device=device, dtype="float32", enable_prefix_caching=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_tokens(family: str) -> dict:
    from model.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        path = make_tiny_checkpoint(family, directory)
        cpu, cuda = greedy_tokens(path, "cpu"), greedy_tokens(path, "cuda")
    return {"ok": cpu == cuda, "cpu": cpu, "cuda": cuda}


def check_paris(quantization: str) -> dict:
    from loom import LLM, SamplingParams

    with LLM(device="cuda", dtype="bfloat16", quantization=quantization) as llm:
        output = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    text = output[0].outputs[0].text
    return {"ok": "Paris" in text, "text": text}


def run(command: list[str], timeout: int) -> dict:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return {"ok": done.returncode == 0, "seconds": round(time.perf_counter() - started, 1),
            "tail": (done.stdout + done.stderr)[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cuda_check.json"))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    checks = {
        "tokens llama": lambda: check_tokens("llama"),
        "tokens qwen3_moe": lambda: check_tokens("qwen3_moe"),
        "paris none": lambda: check_paris("none"),
        "paris auto": lambda: check_paris("auto"),
        "cuda ipc weight updates": lambda: run(
            [sys.executable, "examples/rl_weight_sync.py", "--device", "cuda", "--rounds", "2"],
            300),
        "bench latency": lambda: run(
            [sys.executable, "-m", "loom.cli", "bench", "latency", "--device", "cuda",
             "--input-len", "128", "--output-len", "128", "--batch-size", "1", "32"], 300),
    }
    results, failed = {"device": torch.cuda.get_device_name(0)}, 0
    for name, check in checks.items():
        try:
            result = check()
        except Exception:  # noqa: BLE001 - one failed check must not stop the others
            result = {"ok": False, "error": traceback.format_exc()[-2000:]}
        results[name] = result
        failed += not result["ok"]
        print(f"{'PASS' if result['ok'] else 'FAIL'} {name}: "
              f"{json.dumps({k: v for k, v in result.items() if k != 'ok'})[:600]}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return failed


if __name__ == "__main__":
    sys.exit(main())
