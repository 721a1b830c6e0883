"""First-step vs steady-step latency of the worker, with and without ``Worker.warm_up``.

Starts a worker the way ``UniProcExecutor`` does (init_device, load_model, profile,
initialize_kv_cache, then warm_up unless ``--no-warm-up``) on the default model
(SmolLM2-135M-Instruct GGUF, bf16), pre-touches its KV cache (``--untouched-kv``:
not), then drives ``Worker.execute_model`` with hand-built ``SchedulerOutput``s:

* the first request after start-up (prefill, first decode) vs the same request next;
* decode at each batch size in ``--batch-sizes`` (ascending, so each is new to the
  process): prefill the batch, then ``--steps`` decode steps; the first decode step
  vs the median of the others;
* prefill chunks of each size in ``--chunks``: a fresh request per step, the first
  step at that size vs the median of the others.

    # both modes, 3 processes each, interleaved; medians (benchmarks/warm_up.md)
    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/warm_up.py --repeat 3 --threads 1 --clock cpu
    nice -n 19 python benchmarks/warm_up.py --no-warm-up   # one process, JSON

On a loaded machine use ``--threads 1 --clock cpu``: CPU time of one thread is not
inflated by time spent descheduled, and two OpenMP threads spin-wait for each other
when other processes hold the cores (steps then take ~1 s instead of ~20 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from loom.engine_args import make_engine_config
from loom.core.wire import CachedRequestData, NewRequestData, SchedulerOutput
from loom.core.kv_sizing import cap_num_blocks
from loom.sampling_params import SamplingParams
from loom.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class FakeScheduler:
    """Hands out blocks and builds the diffs a real scheduler would send."""

    def __init__(self, block_size: int, reuse_blocks: bool = True) -> None:
        self.block_size = block_size
        self.reuse_blocks = reuse_blocks  # False: every request writes untouched pages
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.finished: list[str] = []

    def _blocks_for(self, req_id: str, num_tokens: int) -> list[int]:
        have = self.blocks.setdefault(req_id, [])
        need = -(-num_tokens // self.block_size) - len(have)
        new = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        have += new
        return new

    def new(self, req_ids: list[str], prompt_len: int) -> SchedulerOutput:
        reqs = [NewRequestData(req_id=r, prompt_token_ids=[(7 * i + 11) % 1000 + 100
                                                          for i in range(prompt_len)],
                               output_token_ids=[], sampling_params=GREEDY, eos_token_ids=[],
                               block_ids=self._blocks_for(r, prompt_len), num_computed_tokens=0)
                for r in req_ids]
        for r in req_ids:
            self.computed[r] = prompt_len
        return self._output(reqs, [], {r: prompt_len for r in req_ids})

    def decode(self, req_ids: list[str], sampled: dict[str, int]) -> SchedulerOutput:
        cached = []
        for r in req_ids:
            cached.append(CachedRequestData(req_id=r, new_token_ids=[sampled[r]],
                                            new_block_ids=self._blocks_for(r, self.computed[r] + 1),
                                            num_computed_tokens=self.computed[r]))
            self.computed[r] += 1
        return self._output([], cached, {r: 1 for r in req_ids})

    def finish(self, req_ids: list[str]) -> None:
        self.finished += req_ids
        for r in req_ids:
            del self.blocks[r], self.computed[r]
        if not self.blocks and self.reuse_blocks:
            self.next_block = 0

    def flush(self) -> SchedulerOutput:
        """A step that runs nothing and only tells the worker what finished."""
        return self._output([], [], {})

    def _output(self, new, cached, num_scheduled) -> SchedulerOutput:
        output = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=num_scheduled,
                                 total_num_scheduled_tokens=sum(num_scheduled.values()),
                                 finished_req_ids=self.finished)
        self.finished = []
        return output


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def timed(worker: Worker, output: SchedulerOutput) -> tuple[float, dict[str, int]]:
    start = CLOCK()
    result = worker.execute_model(output)
    elapsed = CLOCK() - start
    return elapsed, {r: t[-1] for r, t in zip(result.req_ids, result.sampled_token_ids) if t}


def measure_decode(worker: Worker, scheduler: FakeScheduler, batch: int, prompt_len: int,
                   steps: int) -> tuple[float, float]:
    req_ids = [f"decode-{batch}-{i}" for i in range(batch)]
    _, sampled = timed(worker, scheduler.new(req_ids, prompt_len))
    times = []
    for _ in range(steps):
        elapsed, sampled = timed(worker, scheduler.decode(req_ids, sampled))
        times.append(elapsed)
    scheduler.finish(req_ids)
    return times[0], statistics.median(times[1:])


def measure_first_requests(worker: Worker, scheduler: FakeScheduler,
                           prompt_len: int) -> dict[str, tuple[float, float]]:
    """The first request after start-up against the same request run next: its
    prefill, and its first decode step (batch 1)."""
    times = []
    for req_id in ("first", "second"):
        prefill, sampled = timed(worker, scheduler.new([req_id], prompt_len))
        decode, _ = timed(worker, scheduler.decode([req_id], sampled))
        scheduler.finish([req_id])
        times.append((prefill, decode))
    return {"first request prefill": (times[0][0], times[1][0]),
            "first request decode": (times[0][1], times[1][1])}


def measure_prefill(worker: Worker, scheduler: FakeScheduler, chunk: int,
                    steps: int) -> tuple[float, float]:
    times = []
    for step in range(max(3, steps // 2)):
        req_id = f"prefill-{chunk}-{step}"
        elapsed, _ = timed(worker, scheduler.new([req_id], chunk))
        scheduler.finish([req_id])
        times.append(elapsed)
    return times[0], statistics.median(times[1:])


def run_once(args) -> dict:
    """Start a worker, then time first and steady steps; one process, one mode."""
    from loom.default_model import default_model_path

    global CLOCK
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK = time.process_time
    config = make_engine_config(args.model or default_model_path(), dtype="bfloat16",
                                max_model_len=2048, enable_warm_up=not args.no_warm_up)
    worker = Worker(config)
    started = time.perf_counter()
    worker.init_device()
    worker.load_model()
    loaded = time.perf_counter()
    num_blocks = min(cap_num_blocks(config, worker.determine_num_blocks()),
                     4096 if args.untouched_kv else 512)
    worker.initialize_kv_cache(num_blocks)
    if not args.untouched_kv:
        for kv_cache in worker.model_runner.kv_caches:
            kv_cache.zero_()  # first touch of every page now, not inside a timed step
    profiled, profiled_cpu = time.perf_counter(), time.process_time()
    print("# phase: warm-up", flush=True)  # markers for ONEDNN_VERBOSE=profile_create logs
    runner, batch_sizes = worker.model_runner, []  # the warm-up's steps, recorded
    execute_model = runner.execute_model

    def recording(scheduler_output):
        batch_sizes.append(scheduler_output.total_num_scheduled_tokens)
        return execute_model(scheduler_output)

    runner.execute_model = recording
    worker.warm_up()
    runner.execute_model = execute_model
    result = {"warm_up": not args.no_warm_up, "load_s": loaded - started,
              "profile_s": profiled - loaded, "warm_up_s": time.perf_counter() - profiled,
              "warm_up_cpu_s": time.process_time() - profiled_cpu,
              "warmed_up_to_batch": max(batch_sizes[1:], default=0)}

    scheduler = FakeScheduler(config.cache.block_size, reuse_blocks=not args.untouched_kv)
    print("# phase: first requests", flush=True)
    result.update(measure_first_requests(worker, scheduler, args.prompt_len))
    for sweep in range(args.passes):
        for batch in map(int, args.batch_sizes.split(",")):
            print(f"# phase: pass{sweep + 1} decode B={batch}", flush=True)
            result[f"pass{sweep + 1} decode B={batch}"] = measure_decode(
                worker, scheduler, batch, args.prompt_len, args.steps)
        for chunk in map(int, args.chunks.split(",")):
            print(f"# phase: pass{sweep + 1} prefill T={chunk}", flush=True)
            result[f"pass{sweep + 1} prefill T={chunk}"] = measure_prefill(
                worker, scheduler, chunk, args.steps)
    timed(worker, scheduler.flush())
    assert not worker.model_runner.requests
    return result


def report(runs: list[dict]) -> None:
    """Medians over runs of first and steady step (ms), per mode."""
    modes = [(False, "no warm-up"), (True, "warm-up")]
    print("| | " + " | ".join(f"{name}: first / steady ms (+extra)" for _, name in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for key in ("load_s", "profile_s", "warm_up_s", "warm_up_cpu_s", "warmed_up_to_batch"):
        cells = [f"{statistics.median(r[key] for r in runs if r['warm_up'] == mode):.4g}"
                 for mode, _ in modes]
        print(f"| {key} | " + " | ".join(cells) + " |")
    for key in [k for k in runs[0] if k.startswith(("first", "pass"))]:
        cells = []
        for mode, _ in modes:
            firsts = [r[key][0] * 1e3 for r in runs if r["warm_up"] == mode]
            steadies = [r[key][1] * 1e3 for r in runs if r["warm_up"] == mode]
            extras = [f - s for f, s in zip(firsts, steadies)]
            cells.append(f"{statistics.median(firsts):.1f} / {statistics.median(steadies):.1f} "
                         f"({statistics.median(extras):+.1f})")
        print(f"| {key} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--repeat", type=int, default=0,
                        help="run this many processes of each mode, interleaved, and report "
                             "medians (0: one process, the mode given)")
    parser.add_argument("--batch-sizes", default="1,2,3,4,6,8,12,16,24,32,48,64")
    parser.add_argument("--chunks", default="16,100,256,1024")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--passes", type=int, default=1, help="sweeps in one process")
    parser.add_argument("--untouched-kv", action="store_true",
                        help="do not pre-touch the KV cache and never reuse a block, so "
                             "every request writes pages never touched before")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time, which time spent descheduled "
                             "by other processes' work does not inflate (use --threads 1)")
    args = parser.parse_args()
    if not args.repeat:
        print(json.dumps(run_once(args)))
        return
    runs = []
    passthrough, argv = [], iter(sys.argv[1:])
    for arg in argv:
        if arg == "--repeat":
            next(argv)
        elif not arg.startswith("--repeat=") and arg != "--no-warm-up":
            passthrough.append(arg)
    for i in range(2 * args.repeat):
        mode = ["--no-warm-up"] if i % 2 == 0 else []
        out = subprocess.run([sys.executable, __file__, *passthrough, *mode], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"run {i + 1}/{2 * args.repeat} done", file=sys.stderr)
    report(runs)


if __name__ == "__main__":
    main()
