"""The real-weights half of the prepared GPU run (``benchmarks/cuda_check.sh`` runs it).

    python benchmarks/cuda_check.py [--out benchmarks/results/cuda_check.json]

Each check prints one line, PASS or FAIL with the reason, and goes on; the exit status
is the number that failed. It needs the default model (SmolLM2-135M Q4_1):

1. in bf16, ``--quantization none`` and ``auto`` (the file's Q4_1 kept, the PyTorch
   reference path on CUDA), it says Paris; and with ``--attention-backend triton`` (loom's
   Triton attention kernels, dequantized weights);
2. weight updates through CUDA IPC handles: ``examples/rl_weight_sync.py --device cuda``
   (a trainer process publishes GPU tensors, the engine copies device to device);
3. a real server: ``loom serve --device cuda``, ``/health``, a chat completion that
   says Paris, ``/metrics``; then SIGTERM, and it must exit 0. Its resident memory and
   the device memory it holds are reported.

The token-for-token matrix (every family, against transformers on the same GPU) and
the speed run are ``LOOM_TEST_DEVICE=cuda pytest ...`` and ``cuda_speed.py``, in the
shell script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
DEVICE = "cuda"


def check_paris(quantization: str, attention_backend: str = "auto") -> dict:
    from loom import LLM, SamplingParams

    with LLM(device=DEVICE, dtype="bfloat16", quantization=quantization,
             attention_backend=attention_backend) as llm:
        output = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    text = output[0].outputs[0].text
    return {"ok": "Paris" in text, "text": text}


def check_served() -> dict:
    import signal
    import socket

    import httpx
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "loom.cli", "serve", "--device", DEVICE,
                               "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base, result = f"http://127.0.0.1:{port}", {"ok": False}
    try:
        deadline = time.time() + 240
        while time.time() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"not ready (exit {server.poll()})")
        result["ready_s"] = round(time.perf_counter() - started, 1)
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}).json()
        result["text"] = reply["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        tree = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)
        result["rss_mib"] = {f"{p.pid} {p.name()}": round(p.memory_info().rss / 2**20)
                             for p in tree}
        if DEVICE == "cuda":
            smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            result["device_memory"] = smi.stdout.strip()
        server.send_signal(signal.SIGTERM)
        result["exit"] = server.wait(timeout=60)
        result["ok"] = ("Paris" in result["text"] and result["exit"] == 0
                        and "loom" in metrics)
    finally:
        if server.poll() is None:
            server.kill()
        result["log_tail"] = server.stdout.read()[-1500:]
    return result


def run(command: list[str], timeout: int) -> dict:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return {"ok": done.returncode == 0, "seconds": round(time.perf_counter() - started, 1),
            "tail": (done.stdout + done.stderr)[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cuda_check.json"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: try the script itself on a machine without a GPU")
    parser.add_argument("--only", nargs="*", default=None,
                        help="these checks alone (each in its own process: a crash in one "
                             "leaves the others their say)")
    args = parser.parse_args()
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    checks = {
        "paris none": lambda: check_paris("none"),
        "paris auto": lambda: check_paris("auto"),
        "paris triton": lambda: check_paris("none", "triton"),
        "cuda ipc weight updates": lambda: run(
            [sys.executable, "examples/rl_weight_sync.py", "--device", DEVICE, "--rounds", "2"],
            300),
        "served": check_served,
    }
    results, failed = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"}, 0
    for name, check in checks.items():
        if args.only is not None and name not in args.only:
            continue
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
