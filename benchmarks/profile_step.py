"""Time the model's forward step on CPU: decode at several batch sizes and a prefill.

Builds the model (default: SmolLM2-135M-Instruct GGUF) in bf16, binds a paged KV
cache, and runs through the real attention backend with metadata laid out as the
model runner lays it out (shuffled blocks, one request after another). Reports the
median step time and tokens/s per step type, the roofline of a batch-1 decode
(weight bytes / memory bandwidth, measured here with a large copy), and with
``--profile`` a per-op table from ``torch.profiler``.

    python benchmarks/profile_step.py                       # all step types
    python benchmarks/profile_step.py --batch 1 --profile   # one, with per-op table
    OMP_WAIT_POLICY=PASSIVE python benchmarks/profile_step.py   # on a busy machine

The CPU is shared with whatever else runs: medians over ``--iters`` steps, and run
baseline and candidate in the same sitting, interleaved. When other processes hold
the cores, OpenMP's default spin-waiting makes 2 threads 3-10x slower than 1;
``OMP_WAIT_POLICY=PASSIVE`` (set before torch is imported) or ``--threads 1`` avoids it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from loom.model.attention.metadata import AttentionMetadata, set_forward_context


def build_model(model_path: str, dtype: torch.dtype):
    from loom.model.loader import load_hf_config, load_model

    start = time.perf_counter()
    config = load_hf_config(model_path)
    config_s = time.perf_counter() - start
    model = load_model(model_path, config, dtype=dtype)
    load_s = time.perf_counter() - start - config_s
    print(f"load_hf_config {config_s:.2f} s, load_model {load_s:.2f} s")
    return model, config


class PagedBatch:
    """A batch of requests with shuffled KV blocks; builds each step's inputs once."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        self.block_size = block_size
        shape = model.kv_cache_shape(num_blocks, block_size)
        model.bind_kv_cache([torch.zeros(shape, dtype=dtype)
                             for _ in range(model.num_attention_layers)])
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)

    def step_inputs(self, context_lens: list[int], query_lens: list[int]):
        """Requests whose contexts end at ``context_lens`` with ``query_lens`` new tokens."""
        positions, slots, block_tables, starts = [], [], [], [0]
        for ctx, q in zip(context_lens, query_lens):
            num_blocks = -(-ctx // self.block_size)
            table = [self.free[(len(block_tables) * 1009 + i) % len(self.free)]
                     for i in range(num_blocks)]
            block_tables.append(table)
            for pos in range(ctx - q, ctx):
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            starts.append(starts[-1] + q)
        width = max(len(t) for t in block_tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                     dtype=torch.int32),
            query_start_loc_cpu=starts, seq_lens_cpu=list(context_lens),
            max_query_len=max(query_lens), max_seq_len=max(context_lens),
            block_size=self.block_size)
        input_ids = torch.randint(100, 1000, (len(positions),))
        logits_indices = torch.tensor(starts[1:]) - 1
        return input_ids, torch.tensor(positions), metadata, logits_indices


def run_step(model, inputs) -> torch.Tensor:
    input_ids, positions, metadata, logits_indices = inputs
    with set_forward_context(metadata):
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden[logits_indices])


def time_steps(model, inputs, iters: int, warmup: int = 3) -> float:
    with torch.inference_mode():
        for _ in range(warmup):
            run_step(model, inputs)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run_step(model, inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth_gbs() -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / min(times) / 1e9  # read + write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192, help="context length at decode")
    parser.add_argument("--prefill", type=int, default=128, help="prefill tokens (0: skip)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print a per-op table")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.model is None:
        from loom.default_model import default_model_path

        args.model = default_model_path()
    model, _ = build_model(args.model, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = memory_bandwidth_gbs()
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(f"threads {torch.get_num_threads()}, weights {weight_bytes / 2**20:.0f} MiB, "
          f"copy bandwidth {bandwidth:.1f} GB/s -> batch-1 roofline {floor_ms:.2f} ms "
          f"({1e3 / floor_ms:.0f} tok/s)")

    batch = PagedBatch(model, num_blocks=max(args.batch + [1]) * (args.context // 16 + 2)
                       + args.prefill // 16 + 8, block_size=args.block_size, dtype=dtype)
    cases = [(f"decode b={b} ctx={args.context}", [args.context] * b, [1] * b, b)
             for b in args.batch]
    if args.prefill:
        cases.append((f"prefill {args.prefill}", [args.prefill], [args.prefill], args.prefill))
    for name, context_lens, query_lens, tokens in cases:
        inputs = batch.step_inputs(context_lens, query_lens)
        first_start = time.perf_counter()
        with torch.inference_mode():
            run_step(model, inputs)
        first_s = time.perf_counter() - first_start
        step_s = time_steps(model, inputs, args.iters)
        print(f"{name:>24}: {step_s * 1e3:8.2f} ms/step  {tokens / step_s:8.0f} tok/s"
              f"  (first step {first_s * 1e3:.0f} ms)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    run_step(model, inputs)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
