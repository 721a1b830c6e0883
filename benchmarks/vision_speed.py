"""Images in: loom against llama.cpp's multimodal server and transformers on the same
Qwen2.5-VL weights, interleaved, a fresh process per engine per round.

    python benchmarks/vision_speed.py [--model DIR] [--gguf F.gguf --mmproj M.gguf] \\
        [--loom-api server|offline] [--rounds 3] [--result-file results/vision-speed-CPU.json]

The checkpoint is benchmarks/make_vlm.py's (a 1B-class random Qwen2.5-VL, bfloat16) and
its llama.cpp conversion. Every request is one 448 x 448 image (256 rows after the
tower's merge) and a short question under the chat template, greedy, ``--new-tokens``
tokens with EOS ignored; each image is different (seeded noise), so no engine's prefix
or image cache serves one request from another. Per engine and round, in one process:

- a warm-up request (its own image, 8 tokens), untimed;
- one request alone: **image to first token** (from sending the request until its first
  token arrives: image preprocessing, the vision tower, the prompt's prefill and the
  first sample) and **decode tok/s** (the later tokens over the time from the first
  token to the last);
- ``--concurrent`` requests at once, each with its own image: the time until the last
  finishes and the output tokens per second over it, and their median first token.

The engines, each as its users run it:

- loom, ``--loom-api server`` (default): ``loom serve DIR --dtype bfloat16``, and
  llama.cpp: ``llama-server -m GGUF --mmproj MMPROJ -t 2 -tb 2 -np N -c N x 1024``, each
  sent the same OpenAI request on ``/v1/chat/completions``: an ``image_url`` part (the
  image as a PNG data URL) and the question, streamed (a token a chunk; the count from
  ``usage``); llama.cpp's ``cache_prompt`` off. Both chat templates (the checkpoint's)
  write the same prompt: loom's ``<|vision_start|><|image_pad|><|vision_end|>``,
  expanded to the image's rows, where llama.cpp's mtmd writes ``<|vision_start|>``, the
  rows, ``<|vision_end|>``.
- loom, ``--loom-api offline``: ``LLM.generate`` in the child process, the templated
  prompt text with a PIL image in ``multi_modal_data`` (no HTTP, no PNG to decode);
  first-token time from the request's ``metrics``.
- transformers: ``Qwen2_5_VLForConditionalGeneration.generate`` in bfloat16 (SDPA),
  the image processor and the placeholder's expansion as its processor does them; the
  concurrent requests as one batch of ``--concurrent`` (equal lengths, no padding);
  token times from a streamer.

Each side's prompt length in tokens is recorded (they must agree), and each process's
peak resident memory (VmHWM; for a server, each process of its tree). The roofline:
every round's memory bandwidth (benchmarks/roofline.py, in its own process) and torch's
bfloat16 matmul rate; a batch-1 decode step reads the text model's weights once (the
tower is idle), and an image request's first token needs the tower's and the prompt's
FLOPs (``compute`` in the result). The concurrent requests' floor
(``concurrent_floor_s``) is all of their first tokens' FLOPs at the matmul rate plus
their later tokens' steps at the memory's; each engine's ``concurrent_over_floor`` says
how far above it that engine ran.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from fresh_process import run_in_child

ENVS = os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs")
MODELS = os.path.join(ENVS, "models")

QUESTION = "Describe this image in one sentence."
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_SIDE = 448
WARM_UP_SEED, SINGLE_SEED, CONCURRENT_FIRST_SEED = 100, 1, 10
WARM_UP_TOKENS = 8


def prompt_text(placeholder: str) -> str:
    return f"<|im_start|>user\n{placeholder}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))


def png_base64(seed: int) -> str:
    buffer = io.BytesIO()
    image(seed).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def concurrent_seeds(count: int) -> list[int]:
    return list(range(CONCURRENT_FIRST_SEED, CONCURRENT_FIRST_SEED + count))


def resident_mib(pid: int, field: str = "VmHWM") -> int:
    """A process's peak (VmHWM) or present (VmRSS) resident memory in MiB; 0 where it
    is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return round(int(line.split()[1]) / 1024)
    except FileNotFoundError:
        pass
    return 0


def tree_memory_mib(pid: int) -> dict[str, dict[str, int]]:
    """Peak and present resident MiB of ``pid`` and each of its descendants, by
    ``pid:name``."""
    from quantized import tree_pids

    peak, present = {}, {}
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/comm") as f:
                name = f"{p}:{f.read().strip()}"
        except FileNotFoundError:
            continue
        peak[name], present[name] = resident_mib(p), resident_mib(p, "VmRSS")
    return {"peak_rss_mib": peak, "rss_at_end_mib": present}


def summarize(single: dict, concurrent: list[dict], concurrent_s: float,
              prompt_tokens: int) -> dict:
    """The figures from token times: ``single`` and each of ``concurrent`` hold
    ``ttft_s`` (request to first token), ``decode_s`` (first token to last) and
    ``tokens`` (output tokens)."""
    tokens = sum(r["tokens"] for r in concurrent)
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_s": round(single["ttft_s"], 3),
        "decode_tok_s": round((single["tokens"] - 1) / single["decode_s"], 2),
        "single_output_tokens": single["tokens"],
        "concurrent_s": round(concurrent_s, 3),
        "concurrent_output_tokens": tokens,
        "concurrent_output_tok_s": round(tokens / concurrent_s, 2),
        "concurrent_median_ttft_s": round(statistics.median(r["ttft_s"] for r in concurrent), 3),
    }


# ----------------------------------------------------------------------------- loom offline

def run_loom_offline(model: str, new_tokens: int, concurrent: int) -> dict:
    from loom import LLM, SamplingParams
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as loom's own processes run a CPU worker
    started = time.perf_counter()
    llm = LLM(model, dtype="bfloat16")
    load_s = time.perf_counter() - started
    loaded_rss = resident_mib(os.getpid(), "VmRSS")

    def request(seed: int) -> dict:
        return {"prompt": prompt_text(IMAGE_PLACEHOLDER), "multi_modal_data": {"image": image(seed)}}

    def timed(requests: list[dict], tokens: int) -> tuple[list, float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.time()
        outputs = llm.generate(requests, params, use_tqdm=False)
        return outputs, start, time.time()

    def figures(output, start: float, end: float) -> dict:
        first = output.metrics["first_token_time"]
        return {"ttft_s": first - start, "decode_s": end - first,
                "tokens": len(output.outputs[0].token_ids)}

    with llm:
        timed([request(WARM_UP_SEED)], WARM_UP_TOKENS)
        [single], start, end = timed([request(SINGLE_SEED)], new_tokens)
        outputs, start_all, end_all = timed([request(s) for s in concurrent_seeds(concurrent)],
                                            new_tokens)
        memory = tree_memory_mib(os.getpid())  # with loom's worker processes, if any
    result = summarize(figures(single, start, end),
                       [figures(o, start_all, end_all) for o in outputs], end_all - start_all,
                       len(single.prompt_token_ids))
    return {**result, "load_s": round(load_s, 1), "rss_after_load_mib": loaded_rss, **memory}


# ----------------------------------------------------------------------------- HTTP servers

def start_server(command: list[str], log_path: str, timeout_s: float = 600) -> tuple[subprocess.Popen, int, float]:
    """``command`` (``{port}`` in it replaced by a free port) in its own session; the
    process, its port and the seconds until it listed its models."""
    from run_all import _free_port, wait_ready

    port = _free_port()
    command = [part.replace("{port}", str(port)) for part in command]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if not wait_ready(port, proc, timeout_s):
        from run_all import _stop

        _stop(proc)
        with open(log_path) as f:
            raise SystemExit(f"{command[0]} did not start:\n{f.read()[-3000:]}")
    return proc, port, time.perf_counter() - started


def stream(url: str, body: dict, count_tokens) -> dict:
    """POST ``body`` to ``url`` and read its server-sent events; ``count_tokens(chunk)``
    says how many tokens a chunk carries. Request to first token, first to last token,
    the tokens and the last chunk."""
    import httpx

    times: list[float] = []
    tokens, last = 0, None
    start = time.perf_counter()
    with httpx.stream("POST", url, json=body, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: "
                               f"{response.read().decode()[:1000]}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            new = count_tokens(chunk)
            if new:
                times.append(time.perf_counter())
                tokens += new
            last = chunk
    if not times:
        raise RuntimeError(f"{url} streamed no tokens; last chunk: {last}")
    return {"ttft_s": times[0] - start, "decode_s": times[-1] - times[0], "tokens": tokens,
            "last": last, "end": times[-1]}


def drive(send, seeds: list[int], new_tokens: int) -> tuple[dict, list[dict], float]:
    """Warm-up, one request alone, then ``seeds`` at once, each on its own thread.
    ``send(seed, tokens)`` gives ``stream``'s figures with ``end``, its last token's time."""
    send(WARM_UP_SEED, WARM_UP_TOKENS)
    single = send(SINGLE_SEED, new_tokens)
    results: list[Any] = [None] * len(seeds)

    def one(index: int, seed: int) -> None:
        try:
            results[index] = send(seed, new_tokens)
        except Exception as error:  # noqa: BLE001 (raised below, not lost with the thread)
            results[index] = error

    threads = [threading.Thread(target=one, args=(i, s)) for i, s in enumerate(seeds)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(seeds)} concurrent requests failed: "
                           f"{failed[0]}")
    return single, results, max(r["end"] for r in results) - start


def chat_request(seed: int, tokens: int) -> dict:
    """The OpenAI chat request both servers get: the image as a PNG data URL, then the
    question; greedy, ``tokens`` tokens, streamed with usage."""
    content = [{"type": "image_url",
                "image_url": {"url": f"data:image/png;base64,{png_base64(seed)}"}},
               {"type": "text", "text": QUESTION}]
    return {"model": "vlm", "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def chat_tokens(chunk: dict) -> int:
    """Tokens a chat chunk carries: one a chunk with text (both servers stream a token a
    chunk; the opening chunk with the role only carries none); the count itself comes
    from ``usage``."""
    choices = chunk.get("choices") or []
    return int(bool(choices and (choices[0].get("delta") or {}).get("content")))


def run_server(engine: str, command: list[str], extra: dict, new_tokens: int,
               concurrent: int) -> dict:
    """``command`` (``{port}`` for its port) serving, driven through
    ``/v1/chat/completions`` (``extra`` added to each request); its tree's peak memory."""
    from run_all import _stop

    log = os.path.join(tempfile.gettempdir(), f"vision-speed-{engine}-{os.getpid()}.log")
    proc, port, load_s = start_server(command, log)

    def send(seed: int, tokens: int) -> dict:
        result = stream(f"http://127.0.0.1:{port}/v1/chat/completions",
                        chat_request(seed, tokens) | extra, chat_tokens)
        usage = result["last"].get("usage") or {}
        result["prompt_tokens"] = usage.get("prompt_tokens")
        result["tokens"] = usage.get("completion_tokens", result["tokens"])
        return result

    try:
        single, results, seconds = drive(send, concurrent_seeds(concurrent), new_tokens)
        memory = tree_memory_mib(proc.pid)
    finally:
        _stop(proc)
    return {**summarize(single, results, seconds, single["prompt_tokens"]),
            "load_s": round(load_s, 1), **memory, "command": " ".join(command)}


def run_llamacpp(gguf: str, mmproj: str, llama_bin: str, new_tokens: int, concurrent: int,
                 threads: int) -> dict:
    command = [os.path.join(llama_bin, "llama-server"), "-m", gguf, "--mmproj", mmproj,
               "--port", "{port}", "-t", str(threads), "-tb", str(threads),
               "-np", str(concurrent), "-c", str(concurrent * 1024), "--no-webui"]
    return run_server("llamacpp", command, {"cache_prompt": False}, new_tokens, concurrent)


def run_loom_server(model: str, new_tokens: int, concurrent: int) -> dict:
    command = [sys.executable, "-m", "loom.cli", "serve", model, "--port", "{port}",
               "--dtype", "bfloat16", "--served-model-name", "vlm", "--disable-log-requests"]
    return run_server("loom", command, {}, new_tokens, concurrent)


# ----------------------------------------------------------------------------- transformers

def run_transformers(model: str, new_tokens: int, concurrent: int) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.generation.streamers import BaseStreamer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    started = time.perf_counter()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    merge = hf.config.vision_config.spatial_merge_size ** 2
    load_s = time.perf_counter() - started
    loaded_rss = resident_mib(os.getpid(), "VmRSS")

    class Clock(BaseStreamer):
        """The time of every step's tokens; the first ``put`` is the prompt."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(seeds: list[int], tokens: int) -> tuple[dict, int]:
        """``seeds``' requests as one batch, preprocessing included (Qwen2.5-VL's
        processor: the image processor, then one <|image_pad|> per merged row)."""
        clock = Clock()
        start = time.perf_counter()
        pixels = processor(images=[image(s) for s in seeds], return_tensors="pt")
        rows = (pixels["image_grid_thw"].prod(-1) // merge).tolist()
        texts = [prompt_text(IMAGE_PLACEHOLDER.replace("<|image_pad|>", "<|image_pad|>" * n))
                 for n in rows]
        inputs = tokenizer(texts, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(**inputs, pixel_values=pixels["pixel_values"],
                              image_grid_thw=pixels["image_grid_thw"], max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, streamer=clock)
        steps = clock.times[1:]
        assert out.shape[1] - inputs["input_ids"].shape[1] == tokens == len(steps)
        return ({"ttft_s": steps[0] - start, "decode_s": steps[-1] - steps[0], "tokens": tokens,
                 "end": steps[-1] - start}, inputs["input_ids"].shape[1])

    generate([WARM_UP_SEED], WARM_UP_TOKENS)
    single, prompt_tokens = generate([SINGLE_SEED], new_tokens)
    batch, _ = generate(concurrent_seeds(concurrent), new_tokens)
    result = summarize(single, [batch] * concurrent, batch["end"], prompt_tokens)
    return {**result, "load_s": round(load_s, 1), "rss_after_load_mib": loaded_rss,
            **tree_memory_mib(os.getpid())}


# ----------------------------------------------------------------------------- roofline

def measure_machine(threads: int) -> dict:
    """Memory bandwidth (roofline.py) and torch's bfloat16 matmul rate, best of 5 on a
    (1024 x 1280) x (1280 x 3420) product: a vision block's MLP for one 448 x 448 image."""
    import torch
    from roofline import measure_bandwidth

    record = measure_bandwidth(threads=threads)
    a = torch.randn(1024, 1280, dtype=torch.bfloat16)
    b = torch.randn(1280, 3420, dtype=torch.bfloat16)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    record["bf16_matmul_gflop_s"] = round(2 * 1024 * 1280 * 3420 / best / 1e9, 1)
    return record


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compute(model: str, prompt_tokens: int) -> dict:
    """Weight bytes of a batch-1 decode step and the FLOPs before an image request's
    first token (the tower on one 448 x 448 image, then the prompt's prefill)."""
    from roofline import weight_bytes_per_decode_step

    with open(os.path.join(model, "config.json")) as f:
        vision = json.load(f)["vision_config"]
    weights = weight_bytes_per_decode_step(model)
    patches = (IMAGE_SIDE // vision["patch_size"]) ** 2
    hidden, mlp, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    merged = vision["spatial_merge_size"] ** 2
    window = (vision["window_size"] // vision["patch_size"]) ** 2
    full = len(vision["fullatt_block_indexes"])
    linear = depth * (4 * hidden * hidden + 3 * hidden * mlp)  # qkv, proj; gate, up, down
    tower = (2 * patches * (3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
                            * hidden + linear)
             + 4 * patches * hidden * (full * patches + (depth - full) * window)  # QK^T, AV
             + 2 * (patches // merged) * (merged * hidden) * (merged * hidden
                                                              + vision["out_hidden_size"]))
    # the prompt through the text layers (the LM head on its last token only)
    prefill = 2 * prompt_tokens * (weights["params_read_per_step"] - weights["lm_head_params"])
    return {**weights, "tower_gflop": round(tower / 1e9, 1),
            "prefill_gflop": round(prefill / 1e9, 1),
            "first_token_gflop": round((tower + prefill) / 1e9, 1)}


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(MODELS, "qwen2_5_vl-1b-random"))
    parser.add_argument("--gguf", default=os.path.join(MODELS, "qwen2_5_vl-1b-random-bf16.gguf"))
    parser.add_argument("--mmproj",
                        default=os.path.join(MODELS, "mmproj-qwen2_5_vl-1b-random-bf16.gguf"))
    parser.add_argument("--llama-bin", default=os.path.join(ENVS, "llama.cpp", "bin"))
    parser.add_argument("--loom-api", choices=["server", "offline"], default="server")
    parser.add_argument("--engines", nargs="+", default=["loom", "llamacpp", "transformers"],
                        choices=["loom", "llamacpp", "transformers"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {engine: [] for engine in args.engines}
    machine: list[dict] = []
    for index in range(args.rounds):
        others = OthersCpu()
        machine.append(run_in_child("vision_speed", "measure_machine", args.threads))
        machine[-1]["others_cpu_share"] = others.share()
        say(f"round {index + 1} machine: read {machine[-1]['read_gb_s']:.1f} GB/s, copy "
            f"{machine[-1]['copy_gb_s']:.1f} GB/s, bf16 matmul "
            f"{machine[-1]['bf16_matmul_gflop_s']:.0f} GFLOP/s; other processes used "
            f"{machine[-1]['others_cpu_share']:.0%} of the CPUs")
        # rotate the order each round: no engine always runs first or last
        order = args.engines[index % len(args.engines):] + args.engines[:index % len(args.engines)]
        for engine in order:
            others = OthersCpu()
            if engine == "loom" and args.loom_api == "offline":
                result = run_in_child("vision_speed", "run_loom_offline", args.model,
                                      args.new_tokens, args.concurrent)
            elif engine == "loom":
                result = run_in_child("vision_speed", "run_loom_server", args.model,
                                      args.new_tokens, args.concurrent)
            elif engine == "llamacpp":
                result = run_in_child("vision_speed", "run_llamacpp", args.gguf, args.mmproj,
                                      args.llama_bin, args.new_tokens, args.concurrent,
                                      args.threads)
            else:
                result = run_in_child("vision_speed", "run_transformers", args.model,
                                      args.new_tokens, args.concurrent)
            result["others_cpu_share"] = others.share()
            runs[engine].append(result)
            say(f"round {index + 1} {engine}: first token {result['ttft_s']:.2f} s, decode "
                f"{result['decode_tok_s']:.1f} tok/s, {args.concurrent} at once "
                f"{result['concurrent_s']:.1f} s ({result['concurrent_output_tok_s']:.1f} "
                f"tok/s), prompt {result['prompt_tokens']} tokens, peak RSS "
                f"{result['peak_rss_mib']} MiB; other processes used "
                f"{result['others_cpu_share']:.0%} of the CPUs")
    summary = report(args, runs, machine)
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


class OthersCpu:
    """The share of the machine's CPU time that processes other than this one's children
    took from construction to ``share()``: how busy the host was around a figure (a
    child's servers are waited for by it, so their time counts as ours)."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.monotonic(), busy, children.ru_utime + children.ru_stime

    def share(self) -> float:
        (wall0, busy0, ours0), (wall1, busy1, ours1) = self.start, self._now()
        return round(max(0.0, (busy1 - busy0) - (ours1 - ours0))
                     / ((wall1 - wall0) * os.cpu_count()), 3)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def report(args: argparse.Namespace, runs: dict[str, list[dict]], machine: list[dict]) -> dict:
    prompt_tokens = {engine: sorted({r["prompt_tokens"] for r in rs}) for engine, rs in runs.items()}
    if len({tuple(v) for v in prompt_tokens.values()}) > 1:
        say(f"warning: the engines' prompts differ in length: {prompt_tokens}")
    first_prompt = next(iter(prompt_tokens.values()))[0]
    work = compute(args.model, first_prompt)
    read_gb_s = statistics.median(max(m["read_gb_s"], m["copy_gb_s"]) for m in machine)
    matmul = statistics.median(m["bf16_matmul_gflop_s"] for m in machine)
    step_floor_s = work["weight_bytes_per_step"] / (read_gb_s * 1e9)
    # the concurrent requests' floor: every request's tower and prefill FLOPs at the
    # matmul rate, then their later tokens' steps at the memory's (one read of the
    # weights a step, whatever the batch)
    concurrent_floor_s = (args.concurrent * work["first_token_gflop"] / matmul
                          + (args.new_tokens - 1) * step_floor_s)
    medians = {}
    for engine, rs in runs.items():
        medians[engine] = {key: round(statistics.median(r[key] for r in rs), 3) for key in (
            "ttft_s", "decode_tok_s", "concurrent_s", "concurrent_output_tok_s",
            "concurrent_median_ttft_s", "load_s", "others_cpu_share")}
        # a server's processes summed (each at its own peak: an upper bound)
        medians[engine]["peak_rss_mib_max"] = max(sum(r["peak_rss_mib"].values()) for r in rs)
        medians[engine]["rss_at_end_mib_max"] = max(sum(r["rss_at_end_mib"].values())
                                                    for r in rs)
        medians[engine]["decode_share_of_roofline"] = round(
            medians[engine]["decode_tok_s"] * step_floor_s, 3)
        medians[engine]["first_token_gflop_s"] = round(
            work["first_token_gflop"] / medians[engine]["ttft_s"], 1)
        medians[engine]["concurrent_over_floor"] = round(
            medians[engine]["concurrent_s"] / concurrent_floor_s, 3)
    ratios = {}
    if "loom" in runs:
        for engine, other in runs.items():
            if engine == "loom":
                continue
            # per round, then the median: both sides of a ratio met the same minutes
            pairs = list(zip(runs["loom"], other))
            ratios[f"loom_over_{engine}"] = {
                "ttft": round(statistics.median(o["ttft_s"] / l["ttft_s"] for l, o in pairs), 3),
                "decode": round(statistics.median(
                    l["decode_tok_s"] / o["decode_tok_s"] for l, o in pairs), 3),
                "concurrent": round(statistics.median(
                    l["concurrent_output_tok_s"] / o["concurrent_output_tok_s"]
                    for l, o in pairs), 3)}
    return {
        "command": "python benchmarks/vision_speed.py " + " ".join(sys.argv[1:]),
        "loom_api": args.loom_api, "model": args.model, "gguf": args.gguf,
        "mmproj": args.mmproj, "new_tokens": args.new_tokens, "concurrent": args.concurrent,
        "image": f"{IMAGE_SIDE}x{IMAGE_SIDE}", "prompt_tokens": prompt_tokens,
        "medians": medians, "ratios_median_of_rounds": ratios,
        "roofline": {**work, "bandwidth_gb_s_median": round(read_gb_s, 1),
                     "bf16_matmul_gflop_s_median": matmul,
                     "decode_step_floor_ms": round(step_floor_s * 1000, 1),
                     "batch1_decode_ceiling_tok_s": round(1 / step_floor_s, 1),
                     "first_token_floor_s": round(work["first_token_gflop"] / matmul, 3),
                     "concurrent_floor_s": round(concurrent_floor_s, 3)},
        "machine": machine, "runs": runs}


if __name__ == "__main__":
    main()
