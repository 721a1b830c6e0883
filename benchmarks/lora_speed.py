"""LoRA adapters against the base model, interleaved: decode tokens per second at batch 1
with an adapter, and 8 concurrent requests over 4 adapters, each beside the base model
alone (an engine without LoRA) at the same concurrency; every process's peak memory.

    python benchmarks/lora_speed.py --model /work/bench-envs/models/llama-1b-random \\
        [--rank 16] [--rounds 3] [--result-file results/lora-speed.json]

The adapters (rank ``--rank`` on every linear: q, k, v, o, gate, up, down; random A and
B) are written once with PEFT into ``--adapters-dir``. Each figure is one fresh process:
a 32-token prompt (8 of them for the concurrent case, distinct), 64 new tokens each, greedy,
timed after a warm-up generation of the same shape; tokens per second of output. A figure
during which other processes took more than ``--max-others-share`` of the CPU is
measured again, up to ``--tries`` times (the disturbed figures are kept in the JSON).

Beside llama.cpp (``--llama-cpp``): one rank-``--rank`` adapter, converted by llama.cpp's
own ``convert_lora_to_gguf.py`` (bf16), served on the base's GGUF by
``llama-server -m GGUF --lora ADAPTER.gguf`` and by ``loom serve GGUF --lora-modules
a=ADAPTER.gguf``, a fresh server per figure, the engines alternating (the first one
alternating by round); each gets a warm-up request, then one streamed completion of
``--new-tokens`` (greedy) alone: batch-1 decode tokens per second (first token to last),
and the peak resident memory of every process of the server. A figure during which
other processes took more than ``--max-others-share`` of the CPU is measured again, up
to ``--tries`` times (the host is shared; the disturbed figures are kept in the JSON). First, loom's tokens with
the converted file are checked against its tokens with the PEFT directory, on the same
base in one process (the file's tensors are PEFT's, B times alpha / r: they must equal).

    python benchmarks/lora_speed.py --llama-cpp --model /work/bench-envs/models/llama-1b-random \
        --gguf /work/bench-envs/models/llama-1b-random-bf16.gguf \
        --result-file benchmarks/results/lora-gguf-llamacpp-llama1b-zen5.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from fresh_process import run_in_child

ENVS = os.environ.get("LOOM_BENCH_ENVS", "/work/bench-envs")
LLAMA_SRC = os.path.join(ENVS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
PROMPT = ("The history of the city begins with a small settlement on the river, where "
          "traders from the north and the south met every spring to exchange")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model: str, directory: str, rank: int, count: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [os.path.join(directory, f"adapter{i}") for i in range(count)]
    if all(os.path.exists(os.path.join(p, "adapter_config.json")) for p in paths):
        return paths
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                     target_modules=TARGETS,
                                                     init_lora_weights=False))
        peft_model.save_pretrained(path)
        base = peft_model.unload()
    return paths


def run(model: str, adapters: list[str], case: str, batch: int, rank: int = 16) -> dict:
    """One figure in this process: ``case`` base (no LoRA) or lora, ``batch`` requests."""
    from loom import LLM, LoRARequest, SamplingParams

    lora = case == "lora"
    kwargs = dict(dtype="bfloat16", enable_warm_up=False, max_model_len=256)
    if lora:
        kwargs |= dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                       lora_modules=[f"a{i}={p}" for i, p in enumerate(adapters)])
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(32)]}
               for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    requests = ([LoRARequest(f"a{i % len(adapters)}", i % len(adapters) + 1, adapters[i % len(adapters)])
                 for i in range(batch)] if lora else None)
    with LLM(model, **kwargs) as llm:
        llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        before = busy_cpu_s(os.getpid())
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        seconds = time.perf_counter() - start
        after = busy_cpu_s(os.getpid())
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tok_s": tokens / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "others_cpu_share": others_share(before, after)}


def convert_to_gguf(model: str, adapter: str) -> str:
    """``adapter`` as llama.cpp's convert_lora_to_gguf.py writes it (bf16), beside it."""
    import subprocess

    out = adapter.rstrip("/") + "-bf16.gguf"
    if not os.path.exists(out):
        subprocess.run([sys.executable, os.path.join(LLAMA_SRC, "convert_lora_to_gguf.py"),
                        "--base", model, "--outfile", out, "--outtype", "bf16", adapter],
                       check=True, capture_output=True)
    return out


def check_gguf_tokens(gguf: str, adapter: str, adapter_gguf: str, rank: int) -> dict:
    """loom's greedy tokens on the base's GGUF with the converted adapter, with the PEFT
    directory, and with neither (one process)."""
    from loom import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    with LLM(gguf, dtype="bfloat16", enable_warm_up=False, max_model_len=256,
             enable_lora=True, max_lora_rank=rank) as llm:
        for name, request in (("gguf", LoRARequest("g", 1, adapter_gguf)),
                              ("peft", LoRARequest("p", 2, adapter)), ("base", None)):
            tokens[name] = llm.generate(PROMPT, params, use_tqdm=False,
                                        lora_request=request)[0].outputs[0].token_ids
    return tokens


def busy_cpu_s(server: int) -> tuple[float, float, float]:
    """Now, the machine's busy CPU seconds so far, and those of this process and of the
    server's process tree (this process's children, where ``server`` is this process)."""
    from quantized import tree_pids

    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    ours = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    for pid in tree_pids(server):
        if pid == os.getpid():
            continue  # counted above
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ours += (int(stat[11]) + int(stat[12])) / tick  # utime, stime
        except (FileNotFoundError, ProcessLookupError):
            continue
    return time.monotonic(), busy, ours


def others_share(start: tuple, end: tuple) -> float:
    """The share of the machine's CPU that processes other than this one and the server
    took between ``start`` and ``end`` (``busy_cpu_s``): how disturbed a figure is."""
    wall, busy, ours = (b - a for a, b in zip(start, end))
    return round(max(0.0, busy - ours) / (wall * os.cpu_count()), 3)


def serve_figure(engine: str, gguf: str, adapter_gguf: str, rank: int,
                 new_tokens: int) -> dict:
    """A fresh ``engine`` server with the adapter: a warm-up completion, then one of
    ``new_tokens`` alone, streamed; its decode rate, text and every process's peak."""
    from run_all import _stop
    from vision_speed import start_server, stream, tree_memory_mib

    if engine == "llamacpp":
        command = [os.path.join(ENVS, "llama.cpp", "bin", "llama-server"), "-m", gguf,
                   "--lora", adapter_gguf, "--port", "{port}", "-t", str(os.cpu_count()),
                   "-tb", str(os.cpu_count()), "-np", "1", "-c", "1024", "--no-webui"]
        extra = {"cache_prompt": False}
    else:
        command = [sys.executable, "-m", "loom.cli", "serve", gguf, "--port", "{port}",
                   "--dtype", "bfloat16", "--max-model-len", "1024", "--enable-lora",
                   "--max-lora-rank", str(rank), "--lora-modules", f"a={adapter_gguf}",
                   "--disable-log-requests"]
        extra = {}
    log = os.path.join("/tmp", f"lora-gguf-{engine}-{os.getpid()}.log")
    proc, port, load_s = start_server(command, log)

    def complete(tokens: int) -> dict:
        body = {"model": "a", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}} | extra
        texts: list[str] = []

        def count(chunk: dict) -> int:
            text = (chunk.get("choices") or [{}])[0].get("text") or ""
            texts.append(text)
            return int(bool(text))

        result = stream(f"http://127.0.0.1:{port}/v1/completions", body, count)
        usage = result["last"].get("usage") or {}
        return {**result, "tokens": usage.get("completion_tokens", result["tokens"]),
                "prompt_tokens": usage.get("prompt_tokens"), "text": "".join(texts)}

    try:
        complete(8)
        start = busy_cpu_s(proc.pid)
        timed = complete(new_tokens)
        end = busy_cpu_s(proc.pid)
        memory = tree_memory_mib(proc.pid)
    finally:
        _stop(proc)
    return {"decode_tok_s": round((timed["tokens"] - 1) / timed["decode_s"], 2),
            "ttft_s": round(timed["ttft_s"], 3), "tokens": timed["tokens"],
            "prompt_tokens": timed["prompt_tokens"], "text": timed["text"],
            "load_s": round(load_s, 1), "others_cpu_share": others_share(start, end),
            **memory,
            "command": " ".join(command)}


def llama_cpp_main(args: argparse.Namespace) -> None:
    adapter = write_adapters(args.model, args.adapters_dir, args.rank, 1)[0]
    adapter_gguf = convert_to_gguf(args.model, adapter)
    check = run_in_child("lora_speed", "check_gguf_tokens", args.gguf, adapter, adapter_gguf,
                         args.rank)
    equal = check["gguf"] == check["peft"] and check["gguf"] != check["base"]
    print(f"loom's tokens with the converted GGUF equal the PEFT directory's: {equal}",
          file=sys.stderr)
    engines = ["loom", "llamacpp"]
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for index in range(args.rounds):
        for engine in engines[index % 2:] + engines[:index % 2]:
            disturbed = []  # other processes took more than --max-others-share: again
            for _ in range(args.tries):
                result = serve_figure(engine, args.gguf, adapter_gguf, args.rank,
                                      args.new_tokens)
                if result["others_cpu_share"] <= args.max_others_share:
                    break
                disturbed.append([result["decode_tok_s"], result["others_cpu_share"]])
                print(f"round {index + 1} {engine}: disturbed ({result['decode_tok_s']} "
                      f"tok/s, others' CPU {result['others_cpu_share']:.0%}), again",
                      file=sys.stderr)
                time.sleep(60)
            result["disturbed_tries"] = disturbed
            runs[engine].append(result)
            print(f"round {index + 1} {engine}: {result['decode_tok_s']} tok/s, peak RSS "
                  f"{sum(result['peak_rss_mib'].values())} MiB, others' CPU "
                  f"{result['others_cpu_share']:.0%}", file=sys.stderr)
    medians = {engine: {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                        "peak_rss_mib_max": max(sum(r["peak_rss_mib"].values()) for r in rs)}
               for engine, rs in runs.items()}
    summary = {"command": "python benchmarks/lora_speed.py " + " ".join(sys.argv[1:]),
               "model": args.model, "gguf": args.gguf, "adapter_gguf": adapter_gguf,
               "rank": args.rank, "new_tokens": args.new_tokens,
               "loom_gguf_tokens_equal_peft_directory": equal, "check_tokens": check,
               "medians": medians,
               "median_ratio_loom_over_llamacpp": round(
                   medians["loom"]["decode_tok_s"] / medians["llamacpp"]["decode_tok_s"], 3),
               "runs": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--adapters-dir", default="/tmp/loom-lora-speed")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--llama-cpp", action="store_true",
                        help="one adapter as llama.cpp's GGUF, loom against llama-server")
    parser.add_argument("--gguf", help="the base's GGUF (--llama-cpp)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-others-share", type=float, default=0.1,
                        help="a figure during which other processes took more of the CPU "
                             "is measured again")
    parser.add_argument("--tries", type=int, default=4)
    args = parser.parse_args()
    if args.llama_cpp:
        if not args.gguf:
            parser.error("--llama-cpp needs --gguf, the base's GGUF file")
        llama_cpp_main(args)
        return
    adapters = write_adapters(args.model, args.adapters_dir, args.rank, 4)
    cases = [("base", 1), ("lora", 1), ("base", 8), ("lora", 8)]
    figures: dict[str, list] = {f"{case} b={batch}": [] for case, batch in cases}
    memory: dict[str, list] = {key: [] for key in figures}
    shares: dict[str, list] = {key: [] for key in figures}
    disturbed: dict[str, list] = {key: [] for key in figures}  # [tok/s, others' share]
    for index in range(args.rounds):
        for case, batch in cases:
            key = f"{case} b={batch}"
            for _ in range(args.tries):
                result = run_in_child("lora_speed", "run", args.model,
                                      adapters[:1] if batch == 1 else adapters, case, batch,
                                      args.rank)
                if result["others_cpu_share"] <= args.max_others_share:
                    break
                disturbed[key].append([round(result["tok_s"], 2), result["others_cpu_share"]])
                print(f"round {index + 1} {key}: disturbed ({result['tok_s']:.1f} tok/s, "
                      f"others' CPU {result['others_cpu_share']:.0%}), again", file=sys.stderr)
                time.sleep(30)
            figures[key].append(round(result["tok_s"], 2))
            memory[key].append(round(result["peak_rss_mib"]))
            shares[key].append(result["others_cpu_share"])
            print(f"round {index + 1} {key}: {result['tok_s']:.1f} tok/s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB, others' CPU "
                  f"{result['others_cpu_share']:.0%}", file=sys.stderr)
    ratios = {f"b={batch}": round(statistics.median(
        lora / base for lora, base in zip(figures[f"lora b={batch}"], figures[f"base b={batch}"])),
        3) for batch in (1, 8)}
    summary = {"command": "python benchmarks/lora_speed.py " + " ".join(sys.argv[1:]),
               "model": args.model, "rank": args.rank, "adapters": len(adapters),
               "output_tok_s": figures, "peak_rss_mib": memory,
               "others_cpu_share": shares, "disturbed_tries": disturbed,
               "median_ratio_lora_over_base": ratios}
    print(json.dumps(summary, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
