"""The batch-1 decode roofline: weight bytes read per step ÷ measured memory bandwidth.

A decode step of one sequence reads every weight once (the tied embedding matrix is
read whole by the LM head; the embedding lookup reads one row). Bandwidth is measured
here with large tensor copies (read + write, counted as 2x the bytes) and sums
(read only), over buffers far larger than the last-level cache, best of N.

    python benchmarks/roofline.py --model /work/bench-envs/models/smollm2-135m-bf16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def last_level_cache_mib() -> int:
    """Size of cpu0's largest cache in MiB, from sysfs (0 where it says nothing)."""
    sizes = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], 1 / (1024 * 1024))
        sizes[level] = int(float(text.rstrip("KMG")) * scale)
    return sizes[max(sizes)] if sizes else 0


def measure_bandwidth(size_mib: int = 512, repeats: int = 10, threads: int | None = None) -> dict:
    """Best copy and read speeds over a buffer of at least ``size_mib``, grown to 4x the
    last-level cache where that is larger (one Xeon VM here has 480 MiB of L3: a
    256 MiB buffer would measure the cache, not the memory)."""
    size_mib = max(size_mib, 4 * last_level_cache_mib())
    if threads:
        torch.set_num_threads(threads)
    numel = size_mib * 1024 * 1024 // 4
    src = torch.ones(numel, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_s, read_s = [], []
    dst.copy_(src)
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        read_s.append(time.perf_counter() - start)
    return {"buffer_mib": size_mib, "threads": torch.get_num_threads(),
            "copy_gb_s": 2 * nbytes / min(copy_s) / 1e9,
            "read_gb_s": nbytes / min(read_s) / 1e9}


def weight_bytes_per_decode_step(model_dir: str, dtype_bytes: int = 2) -> dict:
    """Bytes of weights a batch-1 decode step reads, from config.json (a vision-language
    checkpoint's ``text_config``: its tower is idle in decode)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    vocab = c["vocab_size"]
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    norms = 2 * hidden
    per_layer = attention + mlp + norms
    lm_head = vocab * hidden  # read whole, tied or not
    params_read = layers * per_layer + hidden + lm_head
    return {"params_read_per_step": params_read, "lm_head_params": lm_head,
            "dtype_bytes": dtype_bytes,
            "weight_bytes_per_step": params_read * dtype_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF directory (reads config.json)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    bandwidth = measure_bandwidth(threads=args.threads)
    weights = weight_bytes_per_decode_step(args.model)
    best_gb_s = max(bandwidth["copy_gb_s"], bandwidth["read_gb_s"])
    floor_s = weights["weight_bytes_per_step"] / (best_gb_s * 1e9)
    record = {**bandwidth, **weights, "bandwidth_used_gb_s": best_gb_s,
              "decode_step_floor_ms": floor_s * 1000,
              "batch1_decode_ceiling_tok_s": 1 / floor_s}
    print(json.dumps(record, indent=2))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
