"""loom against transformers on one GPU, interleaved, bf16, greedy, random weights.

    python benchmarks/cuda_speed.py [--device cuda] [--rounds 3] [--out FILE]
    python benchmarks/cuda_speed.py --model-file F.gguf   # loom alone on a file

Two shapes, random weights (speed does not depend on their values): SmolLM2-135M's
(the default model's) and the 1B Llama ``make_1b.py`` makes. For each batch size, a
round times loom's ``LLM.generate`` and transformers' ``generate`` on the same weights,
in this process, one after the other: ``--input-len`` prompt tokens, exactly
``--output-len`` new ones; a one-token run of each gives its prefill time, and the
decode rate is the rest. Medians over ``--rounds``. Beside them the roofline: the
weights' bytes over the device's copy bandwidth measured here (bytes read and written),
the fastest a batch-1 step can be. Peak device memory of each is reported too.
loom runs twice, one engine after the other, each interleaved with transformers: as
it runs by default (decode steps replayed from CUDA graphs) and with ``enforce_eager``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
                     rope_theta=10000.0),
}


# loom as it runs by default (decode steps as CUDA graphs: loom/worker/cuda_graphs.py),
# and with every step eager
ENGINES = {"loom": {}, "loom_eager": {"enforce_eager": True}}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read and written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(1 << 30, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def make_model(shape: str, directory: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    for p in model.parameters():  # small random weights: no overflow over 30 layers
        p.data.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def time_loom(llm, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start


def time_hf(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - start


def rates(full: list[float], prefill: list[float], batch: int, output_len: int) -> dict:
    full_s, prefill_s = statistics.median(full), statistics.median(prefill)
    return {"median_e2e_s": round(full_s, 4), "median_prefill_s": round(prefill_s, 4),
            "output_tokens_per_s": round(batch * output_len / full_s, 1),
            "decode_tokens_per_s": round(batch * (output_len - 1) / (full_s - prefill_s), 1),
            "decode_step_ms": round(1000 * (full_s - prefill_s) / (output_len - 1), 3)}


def bench_engine(shape: str, name: str, options: dict, hf, directory: str, args) -> dict:
    """One loom engine (``options``: CUDA graphs on, or ``enforce_eager``) against
    transformers, interleaved round by round, at each batch size."""
    from loom import LLM

    device = args.device
    started = time.perf_counter()
    llm = LLM(directory, device=device, dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=args.input_len + args.output_len + 8,
              enable_prefix_caching=False, seed=0,
              **({"memory_utilization": 0.3} if device == "cuda" else {}), **options)
    start_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch_sizes:
        times = {name: ([], []), "transformers": ([], [])}
        for round_ in range(args.warmup + args.rounds):
            prompts = torch.randint(3, 49152, (batch, args.input_len),
                                    generator=generator).tolist()
            for engine_name, timer, engine in ((name, time_loom, llm),
                                               ("transformers", time_hf, hf)):
                if round_ < args.warmup:
                    timer(engine, prompts, 4, device)
                    continue
                times[engine_name][1].append(timer(engine, prompts, 1, device))
                times[engine_name][0].append(timer(engine, prompts, args.output_len, device))
        row = {"batch_size": batch}
        for engine_name, (full, prefill) in times.items():
            row[engine_name] = rates(full, prefill, batch, args.output_len)
        row[f"{name}_over_transformers_decode"] = round(
            row[name]["decode_tokens_per_s"] / row["transformers"]["decode_tokens_per_s"], 2)
        print(json.dumps({"shape": shape, **row}), flush=True)
        rows.append(row)
    graphs = llm.collective_rpc("cuda_graph_stats")[0] if device == "cuda" else None
    llm.shutdown()
    return {"start_s": round(start_s, 1), "cuda_graphs": graphs, "results": rows}


def bench_shape(shape: str, args, bandwidth: float) -> dict:
    device = args.device
    with tempfile.TemporaryDirectory() as directory:
        hf = make_model(shape, directory, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        engines = {name: bench_engine(shape, name, options, hf, directory, args)
                   for name, options in ENGINES.items() if name in args.engines}
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    roofline_ms = 1000 * weight_bytes / bandwidth
    return {"shape": shape, "weight_bytes": weight_bytes,
            "roofline_step_ms_at_copy_bandwidth": round(roofline_ms, 4),
            "peak_device_bytes_all": peak, "engines": engines}


def bench_file(path: str, args) -> dict:
    """A model file as users have it (the default GGUF), loom only: kept as stored
    (``auto``: the PyTorch reference path on CUDA) and dequantized (``none``), each
    with CUDA graphs and with ``enforce_eager``; decode rates at each batch size."""
    from loom import LLM

    device = args.device
    results = []
    generator = torch.Generator().manual_seed(0)
    for quantization in ("auto", "none"):
        for name, options in ENGINES.items():
            llm = LLM(path, device=device, dtype="bfloat16", quantization=quantization,
                      max_model_len=args.input_len + args.output_len + 8,
                      enable_prefix_caching=False, seed=0,
                      **({"memory_utilization": 0.3} if device == "cuda" else {}), **options)
            for batch in args.batch_sizes:
                full, prefill = [], []
                for round_ in range(args.warmup + args.rounds):
                    prompts = torch.randint(3, 49152, (batch, args.input_len),
                                            generator=generator).tolist()
                    if round_ < args.warmup:
                        time_loom(llm, prompts, 4, device)
                        continue
                    prefill.append(time_loom(llm, prompts, 1, device))
                    full.append(time_loom(llm, prompts, args.output_len, device))
                row = {"quantization": quantization, "engine": name, "batch_size": batch,
                       **rates(full, prefill, batch, args.output_len)}
                print(json.dumps(row), flush=True)
                results.append(row)
            llm.shutdown()
    return {"file": os.path.basename(path), "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--model-file", default=None,
                        help="time loom alone on this file (e.g. the default GGUF) instead")
    args = parser.parse_args()
    if args.model_file:
        record = bench_file(args.model_file, args)
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        return 0
    bandwidth = copy_bandwidth(args.device)
    record = {"device": (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"),
              "torch": torch.__version__, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
              "input_len": args.input_len, "output_len": args.output_len,
              "shapes": [bench_shape(shape, args, bandwidth) for shape in args.shapes]}
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
