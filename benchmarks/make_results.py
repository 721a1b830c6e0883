"""Write benchmarks/RESULTS.md and its plots from the JSON in benchmarks/results/.

    python benchmarks/make_results.py            # RESULTS.md + results/plots/*.png
    python benchmarks/make_results.py --check    # exit 1 if RESULTS.md is not what it would write

Each comparison on the page names its machine, the date and commit that recorded its
file (git's, so figures are never retyped), the exact command that measures it, loom's
ratio to the baseline run beside it and that ratio's spread over the pairs or rounds.
A superseded run is deleted from results/ (git keeps it), so only the newest run of each
comparison is on the page. Every file in results/ is either read by a section here or
named in UNREAD with the reason; a new file that is neither fails ``--check`` (and
tests/test_docs.py), so nothing measured is left off the page by accident.

The plots need matplotlib (``pip install matplotlib``); ``--check`` does not.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "RESULTS.md")
PLOTS = os.path.join(RESULTS, "plots")
README = os.path.join(os.path.dirname(HERE), "README.md")
# README.md's summary table sits between these lines; make_results writes what is between.
SUMMARY_BEGIN = "<!-- results summary: written by benchmarks/make_results.py -->"
SUMMARY_END = "<!-- end of results summary -->"

# The machines the figures come from, by the tag in a result file's name.
MACHINES = {
    "zen5": "2-core AMD EPYC Zen 5 VM (AVX512-BF16/VNNI, no AMX)",
    "zen4": "2-core AMD EPYC Zen 4 VM (AVX512-BF16/VNNI, no AMX)",
    "zen3": "2-core AMD EPYC Zen 3 VM (AVX2, no AVX-512)",
    "intel": "2-core Intel Xeon VM (AVX512-BF16, AMX)",
    "h200": "one NVIDIA H200 (141 GB HBM3e)",
}

# Files in results/ no section reads, and why.
UNREAD = {
    "raw": "run_all.py's per-run files behind summary.json",
    "summary.md": "run_all.py's own table of summary.json",
    "plot.png": "plot_results.py's figure of summary.json, shown in its section",
    "plots": "this page's figures",
    "spec_decode": "spec_decode_bench.sh's runs, summarised in spec_decode.md",
    "ab-trees-*.json": "A/B runs of one tree against the one before (ab_trees.py): not a baseline comparison",
    "attention-ab-*.json": "attention kernel A/B runs (attention_ab.py): not a baseline comparison",
    "bf16_amx.json": "kernel timings on AMX (bf16_amx.py), in cpu_kernels.md",
    "batch_invariance_1b.json": "a correctness check (batch_invariance.py): every format's tokens equal",
    "cuda_check-h200.json": "the GPU correctness run (cuda_check.py), in cuda.md",
    "disaggregation_*.json": "P/D transfer and serving figures, in disaggregation.md",
    "dp-ep-*.json": "DP x EP against TP x EP (dp_ep.py): loom against itself, in dp_ep.md",
    "gemma3_gguf*": "Gemma 3 GGUF parity runs, in gemma3_gguf.md",
    "moba-*.json": "MoBA against full attention (moba.py): loom against itself, in moba.md",
    "router*.json": "the router's added latency (router.py), in router.md",
    "sliding_window_kv*": "KV memory held under sliding windows (sliding_window_kv.py), in sliding_window_kv.md",
    "served-*.log": "the server logs behind served-*.json",
}


@dataclass
class Row:
    """One comparison: loom / baseline = ratio (spread), from one result file."""
    what: str
    baseline: str
    ratio: float
    spread: tuple[float, float] | None
    machine: str
    source: str  # the result file, relative to results/
    command: str
    detail: str = ""
    digits: int = 2  # an accuracy ratio (perplexity over perplexity) wants 4


@dataclass
class Section:
    title: str
    intro: str
    rows: list[Row] = field(default_factory=list)
    plot: str | None = None  # a PNG under results/plots/, or results/plot.png
    notes: list[str] = field(default_factory=list)


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _files(pattern: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, pattern)))


def _spread(values) -> tuple[float, float] | None:
    values = [v for v in values if v is not None]
    return (min(values), max(values)) if len(values) > 1 else None


def _machine_of(name: str, data: dict | None = None) -> str:
    for tag, text in MACHINES.items():
        if re.search(rf"(^|[-_]){tag}([-_.]|$)", name):
            return text
    host = (data or {}).get("host") or (data or {}).get("machine")
    if isinstance(host, str) and "Zen 5" in host:
        return MACHINES["zen5"]
    if isinstance(host, dict) and host.get("cpu"):
        return f"{host.get('cpus', '?')}-core {host['cpu']} VM"
    return "not recorded"


def _git_origin(name: str) -> tuple[str, str]:
    """(date, commit) of the commit that added a result file, following renames."""
    out = subprocess.run(
        ["git", "log", "--follow", "--diff-filter=A", "--format=%ad %h", "--date=short", "--",
         os.path.join(RESULTS, name)], capture_output=True, text=True, cwd=HERE, check=False)
    lines = out.stdout.split()
    return (lines[-2], lines[-1]) if len(lines) >= 2 else ("uncommitted", "-")


def _short(path: str) -> str:
    """A model path as the page names it: the file or directory, not this host's folders."""
    return os.path.basename(path.rstrip("/"))


# -- sections ----------------------------------------------------------------------------

FORMAT_NAMES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "bf16": "bf16",
                "wint4": "wint4 (from the Q4_0 file)", "wint8": "wint8 (from the Q8_0 file)"}


def decode_against_llamacpp() -> Section:
    section = Section(
        "Decode against llama.cpp on the same GGUF file",
        "`benchmarks/interleaved.py`: loom and llama.cpp (`llama-batched-bench` built for the "
        "host) decode the same file in alternating bursts seconds apart, a memory read test "
        "before each pair; the ratio is the median of the pairs' ratios, the spread their "
        "range. 128 prompt tokens, 64 new, both engines on all cores. The default model is "
        "SmolLM2-135M-Instruct's Q4_1 file; the 1B-class model is a random Llama "
        "(`make_1b.py`: 16 layers, hidden 2048) in each format. wint4 / wint8 are loom "
        "quantizing the file's weights at load, against llama.cpp on that file.")
    for name in _files("interleaved-*.json"):
        data = _load(name)
        tag, model, fmt, batch = re.match(r"interleaved-(\w+?)-(default|1b)-(\w+)-b(\d+)", name).groups()
        variant = name[:-len(".json")].split(f"-b{batch}", 1)[1].lstrip("-")
        label = f"{'default' if model == 'default' else '1B'} {FORMAT_NAMES.get(fmt, fmt)}"
        if "one-thread" in variant:
            label += ", one thread each"
        pairs = data.get("pairs", [])
        reads = [p.get("read_gb_s") for p in pairs if p.get("read_gb_s")]
        command = (f"python benchmarks/interleaved.py --model {_short(data['model'])}"
                   + (f" --quantization {data['quantization']}" if data["quantization"] != "auto" else "")
                   + f" --batch {batch} --prompt {data.get('prompt', 128)} --tokens {data.get('tokens', 64)}"
                   + f" --pairs {len(pairs)} --threads {data.get('threads', 2)}")
        share = data.get("median_loom_of_read_test")
        detail = f"batch {batch}, {len(pairs)} pairs"
        if share:
            detail += (f"; loom at {share:.0%} of the read test, llama.cpp "
                       f"{data.get('median_llamacpp_of_read_test', 0):.0%}")
        if reads:
            detail += f"; read {min(reads):.0f}-{max(reads):.0f} GB/s"
        if variant.startswith("run"):
            detail += f"; {variant}"
        section.rows.append(Row(label, "llama.cpp", data["median_ratio"],
                                _spread(p.get("ratio") for p in pairs), _machine_of(name, data),
                                name, command, detail))
    section.rows.sort(key=lambda r: (list(MACHINES.values()).index(r.machine)
                                     if r.machine in MACHINES.values() else 99, r.what,
                                     int(re.search(r"batch (\d+)", r.detail).group(1))))
    section.plot = "plots/decode-vs-llamacpp.png"
    return section


def served_against_llama_server() -> Section:
    section = Section(
        "The default model served, against llama-server",
        "`benchmarks/served_quantized.py`: `loom serve` and `llama-server` on the default "
        "Q4_1 file, 128-token prompts and replies, `loom bench serve` at 1 and 32 concurrent "
        "clients; output tokens per second, peak resident memory of every process of each.")
    for name in _files("served-*.json"):
        data = _load(name)
        for key, ratio in sorted(data.get("ratios", {}).items()):
            clients = key.rsplit("_c", 1)[1]
            medians = data["medians"]
            plural = "client" if clients == "1" else "clients"
            detail = (f"{clients} {plural}; peak RSS loom {medians[f'loom_c{clients}']['peak_rss_mib']:,.0f} "
                      f"MiB, llama-server {medians[f'llamacpp_c{clients}']['peak_rss_mib']:,.0f} MiB")
            section.rows.append(Row(f"default Q4_1, {clients} {plural}", "llama-server", ratio, None,
                                    _machine_of(name, data), name,
                                    f"python benchmarks/served_quantized.py --repeats {data.get('repeats', 1)}",
                                    detail))
    return section


def quantized_prompt() -> Section:
    section = Section(
        "Prompt processing and decode, whole-benchmark runs against llama-bench",
        "`benchmarks/quantized.py`: llama.cpp's `llama-bench` (pp128, tg128) and "
        "`llama-batched-bench` beside `loom bench latency` on the same file, repeated and "
        "paired within each repeat; loom's KV cache sized as llama.cpp's. The ratio is the "
        "median over repeats, the spread their range.")
    for name in _files("quantized-*.json"):
        data = _load(name)
        for pair, figures in sorted(data.get("paired_ratios", {}).items()):
            engine = pair.split("/")[0].replace("loom-", "")
            for what in ("prompt", "b1_decode", "b8_decode", "b32_decode"):
                if what not in figures:
                    continue
                label = f"{_short(data['model'])} ({engine}), " + (
                    "prompt (pp128)" if what == "prompt" else f"decode batch {what[1:].split('_')[0]}")
                medians = data.get("medians", {})
                ours = medians.get(pair.split("/")[0], {}).get("peak_rss_mib")
                theirs = medians.get("llamacpp", {}).get("peak_rss_mib")
                memory = (f"peak RSS loom {ours:,.0f} MiB, llama.cpp {theirs:,.0f} MiB"
                          if ours and theirs and what in ("prompt", "b1_decode") else "")
                section.rows.append(Row(
                    label, "llama.cpp", figures[what]["median"],
                    _spread(figures[what].get("per_repeat", [])), _machine_of(name, data), name,
                    f"python benchmarks/quantized.py --repeats {data.get('repeats', 1)}", memory))
    return section


def default_model_against_engines() -> Section:
    data = _load("summary.json")
    section = Section(
        "The default model in bf16 against vLLM's CPU build, transformers and llama.cpp",
        "`benchmarks/run_all.sh`: SmolLM2-135M-Instruct in bf16, offline (`loom bench "
        "throughput` against vLLM's offline API, transformers' generate and llama.cpp) and "
        "served (`loom bench serve` against `vllm serve` and llama-server) at 1, 8 and 32; "
        "medians of the repeats; roofline from the memory read test run with them.")
    name = "summary.json"
    machine = _machine_of(name, data)
    command = "bash benchmarks/run_all.sh"
    offline = data.get("offline", {})
    for baseline in ("vllm", "transformers", "llamacpp"):
        for batch in ("1", "8", "32"):
            ours = offline.get("loom", {}).get(batch, {}).get("output_tokens_per_s")
            theirs = offline.get(baseline, {}).get(batch, {}).get("output_tokens_per_s")
            if ours and theirs:
                section.rows.append(Row(f"offline output tok/s, batch {batch}", baseline, ours / theirs,
                                        None, machine, name, command,
                                        f"{ours:,.0f} vs {theirs:,.0f} tok/s"))
    serving = data.get("serving", {})
    for baseline in ("vllm", "llamacpp"):
        for clients in ("1", "8", "32"):
            ours = serving.get("loom", {}).get(clients, {}).get("output_throughput")
            theirs = serving.get(baseline, {}).get(clients, {}).get("output_throughput")
            if ours and theirs:
                section.rows.append(Row(f"served output tok/s, {clients} client{'s' if clients != '1' else ''}", baseline,
                                        ours / theirs, None, machine, name, command,
                                        f"{ours:,.0f} vs {theirs:,.0f} tok/s"))
    roofline = data.get("roofline", {})
    if roofline:
        section.notes.append(
            f"Roofline in that run: memory read {roofline['read_gb_s']:.1f} GB/s, so batch-1 "
            f"decode can reach at most {roofline['batch1_decode_ceiling_tok_s']:.0f} tok/s "
            f"({roofline['weight_bytes_per_step'] / 1e6:.0f} MB of weights a step).")
    section.plot = "plot.png"
    return section


def long_prompts() -> Section:
    section = Section(
        "Long prompts against llama.cpp",
        "`benchmarks/long_context.py`: the 1B-class Q4_0 file, one prompt of N tokens, then "
        "32 new tokens, in loom and in `llama-bench` (`-p N -n 32`, the same KV cache type: "
        "f16 beside loom's bf16, q8_0 beside loom's int8 and fp8, which llama.cpp lacks), "
        "alternating; time to the first token and decode speed after the prompt. At 32k, "
        "llama.cpp's two figures come from one `llama-batched-bench` prefill "
        "(`--llama-one-pass`).")
    for name in _files("long-context-*.json"):
        data = _load(name)
        for key, m in sorted(data["medians"].items()):
            length, cache = key.split("/")
            cache = ("bf16 cache" if cache == "auto" else
                     f"{cache} cache (llama.cpp: q8_0)" if cache.startswith("fp8") else
                     f"{cache} cache")
            command = "python benchmarks/" + data["command"].split("benchmarks/", 1)[-1] \
                if data["command"].startswith("python") else "python benchmarks/" + data["command"]
            for what, ratio in (("time to first token", m["ttft_ratio"]),
                                ("decode after it", m["decode_ratio"])):
                detail = (f"{m['loom_ttft_s']:.1f} vs {m['llamacpp_ttft_s']:.1f} s"
                          if what.startswith("time") else
                          f"peak RSS {m['loom_peak_rss_mib']:,.0f} vs {m['llamacpp_peak_rss_mib']:,.0f} MiB")
                section.rows.append(Row(f"{int(length):,} tokens, {cache}: {what}", "llama.cpp",
                                        ratio, None, _machine_of(name, data), name, command, detail))
    return section


def lora() -> Section:
    section = Section(
        "LoRA adapters",
        "`benchmarks/lora_speed.py`: the 1B-class random Llama with rank-16 adapters on "
        "every linear (PEFT's format), engines alternating in fresh processes; against the "
        "base alone at the same concurrency, and against `llama-server --lora` with the "
        "adapter converted by llama.cpp's own script.")
    for name in _files("lora-*.json"):
        data = _load(name)
        machine = _machine_of(name, data)
        if "median_ratio_lora_over_base" in data:
            tok = data["output_tok_s"]
            for key, ratio in data["median_ratio_lora_over_base"].items():
                batch = key.split("=")[1]
                base, with_lora = tok[f"base b={batch}"], tok[f"lora b={batch}"]
                label = ("batch 1 with an adapter" if batch == "1"
                         else f"{batch} requests over {data.get('adapters', '?')} adapters")
                spread = _spread(a / b for a, b in zip(with_lora, base))
                section.rows.append(Row(label, "the base alone", ratio, spread, machine, name,
                                        data["command"], f"{statistics.median(with_lora):.1f} vs "
                                        f"{statistics.median(base):.1f} tok/s"))
        if "median_ratio_loom_over_llamacpp" in data:
            m = data["medians"]
            section.rows.append(Row("batch-1 decode with one adapter (LoRA GGUF)", "llama-server --lora",
                                    data["median_ratio_loom_over_llamacpp"], None, machine, name,
                                    data["command"],
                                    f"{m['loom']['decode_tok_s']} vs {m['llamacpp']['decode_tok_s']} tok/s; "
                                    f"peak RSS {m['loom']['peak_rss_mib_max']:,} vs "
                                    f"{m['llamacpp']['peak_rss_mib_max']:,} MiB"))
    return section


def embeddings() -> Section:
    section = Section(
        "Embeddings against sentence-transformers",
        "`benchmarks/embed_speed.py`: embeddings per second for a batch of short texts, "
        "`LLM.embed` against sentence-transformers' `encode` on the same checkpoint and "
        "dtype, alternating rounds; the first text's cosine between the two checks they agree. "
        "The roofline beside it: each side's share of torch's matmul rate in that dtype, "
        "measured in the run on one layer's MLP shape, and so the most any engine could "
        "gain over sentence-transformers on this CPU.")
    for name in _files("embed-speed-*.json"):
        data = _load(name)
        rates = data["embeddings_per_s"]
        ours, theirs = rates["loom"], rates["sentence-transformers"]
        roofline = data.get("roofline")
        bound = "" if roofline is None else (
            f"; matmul rate {statistics.median(roofline[data['dtype'] + '_matmul_gflop_s']):.0f} "
            f"GFLOP/s, loom at {roofline['share_of_matmul_rate']['loom']:.0%} of it, "
            f"sentence-transformers {roofline['share_of_matmul_rate']['sentence-transformers']:.0%}"
            f" (at most {roofline['most_any_engine_gains_over_st']}x to gain)")
        section.rows.append(Row(
            f"{_short(data['model'])} ({data['dtype']}, {data['texts']} texts)", "sentence-transformers",
            data["median_ratio_loom_over_st"], _spread(a / b for a, b in zip(ours, theirs)),
            _machine_of(name, data), name, data["command"].replace("/tmp/", ""),
            f"{statistics.median(ours):.0f} vs {statistics.median(theirs):.0f} per s; "
            f"cosine {data['cosine_first_text']}{bound}"))
    return section


def kv_tier() -> Section:
    section = Section(
        "A KV tier beyond the pool",
        "`benchmarks/kv_tier.py`: multi-turn chats whose histories outgrow the KV cache, "
        "with and without `--kv-offload-size`; time to the first token on the late turns "
        "(ratio: without / with). `swap`: preempted requests brought back from the tier "
        "against recomputed.")
    for name in _files("kv_tier*.json"):
        data = _load(name)
        ratio = data.get("late_turns_ttft_ratio", data.get("ratio"))
        kind = "late turns' first token" if data["kind"] == "turns" else "preempted requests swapped back"
        section.rows.append(Row(f"{_short(data['model'])}: {kind}", "no tier" if data["kind"] == "turns"
                                else "recomputed", ratio, None, MACHINES["zen5"], name,
                                f"python benchmarks/kv_tier.py --model {_short(data['model'])}"
                                + (" --swap" if data["kind"] == "swap" else ""),
                                f"answers equal: {data.get('answers_equal', data.get('rounds_with_equal_tokens'))}"))
    return section


def image_transport() -> Section:
    section = Section(
        "Images' arrays between processes",
        "`benchmarks/mm_transport.py`: preprocessed pixel arrays (Qwen2.5-VL's shapes) "
        "through each hop a request takes, API process to engine core (`input`) and "
        "engine core to the ranks (`ranks`), by the shared-memory rings against the "
        "bytes inside the messages, interleaved; the ratio is inline time over ring time, "
        "medians of the rounds.")
    for name in _files("mm-transport-*.json"):
        data = _load(name)
        for hop, payloads in data["hops"].items():
            for payload, sides in payloads.items():
                section.rows.append(Row(
                    f"{hop} hop, {payload}", "inside the messages",
                    sides["inline"]["median_ms"] / sides["shm"]["median_ms"], None,
                    _machine_of(name, data), name, data["command"],
                    f"{sides['shm']['median_ms']:.1f} vs {sides['inline']['median_ms']:.1f} ms"))
    return section


def vision() -> Section:
    section = Section(
        "Images in",
        "`benchmarks/vision_speed.py`: a 1B-class random Qwen2.5-VL, one 448x448 image and a "
        "question, served by `loom serve`, `llama-server --mmproj` on the same weights as "
        "GGUF, and transformers; time to first token, decode speed, and 8 concurrent "
        "requests' wall time.")
    for name in _files("vision-speed-*.json"):
        data = _load(name)
        for baseline, key in (("llama.cpp", "loom_over_llamacpp"), ("transformers", "loom_over_transformers")):
            for what, ratio in data["ratios_median_of_rounds"][key].items():
                label = {"ttft": "time to first token", "decode": "decode",
                         "concurrent": f"{data['concurrent']} concurrent requests"}[what]
                medians = data["medians"]
                engine = {"llama.cpp": "llamacpp"}.get(baseline, baseline)
                note = ""
                if what == "concurrent" and "concurrent_over_floor" in medians["loom"]:
                    note = (f"loom {medians['loom']['concurrent_over_floor']:.2f}x the "
                            f"roofline's time, {baseline} "
                            f"{medians[engine]['concurrent_over_floor']:.2f}x")
                section.rows.append(Row(label, baseline, ratio, None, _machine_of(name, data), name,
                                        data["command"], note))
    return section


def perplexity() -> Section:
    section = Section(
        "Accuracy of the kept quantized formats",
        "`benchmarks/perplexity.py`: perplexity over the same tokens, loom on the default "
        "file kept quantized against loom's float32 evaluation of it dequantized, beside "
        "llama.cpp's `llama-perplexity` on the file and its own float32 copy. Here the ratio "
        "is the perplexity over the float32 one (lower is better, 1.0 is exact).")
    for name in _files("perplexity-*.json"):
        data = _load(name)
        section.rows.append(Row("default file kept in Q4_1, loom", "float32 of the same weights",
                                data["loom_kept_bf16"] / data["loom_dequantized_float32"], None,
                                _machine_of(name, data), name, data["command"],
                                f"top-1 agreement with float32 {data['loom_kept_top1_agreement_with_float32']:.2%}",
                                digits=4))
        section.rows.append(Row("default file, llama.cpp", "its float32 copy",
                                data["llamacpp"] / data["llamacpp_float32_copy"], None,
                                _machine_of(name, data), name, data["command"],
                                f"top-1 agreement {data['llamacpp_top1_agreement_with_its_float32_copy']:.2%}",
                                digits=4))
    return section


def kv_cache_accuracy() -> Section:
    section = Section(
        "Accuracy of the int8 KV cache at a 4,096-token context",
        "`benchmarks/perplexity.py --ctx 4096 --tokens 8192 --kv-cache-dtype int8`: "
        "perplexity over two 4,096-token chunks with loom's int8 cache over its bf16 one, "
        "beside llama.cpp's q8_0 cache over its f16 one, on the same file and tokens. The "
        "ratio is the perplexity over the full-precision cache's (1.0 is exact).")
    for name in _files("kv-perplexity-*.json"):
        data = _load(name)
        model = data["model"].split(" ")[0]
        section.rows.append(Row(f"{model}, loom int8 cache", "loom's bf16 cache",
                                data["loom_int8_cache"] / data["loom_bf16_cache"], None,
                                _machine_of(name, data), name, data["command"],
                                f"top-1 agreement with the bf16 cache "
                                f"{data['loom_int8_top1_agreement_with_bf16_cache']:.2%}",
                                digits=4))
        section.rows.append(Row(f"{model}, llama.cpp q8_0 cache", "llama.cpp's f16 cache",
                                data["llamacpp_q8_0_cache"] / data["llamacpp_f16_cache"], None,
                                _machine_of(name, data), name, data["command"], "", digits=4))
    return section


def moe() -> Section:
    section = Section(
        "A mixture of experts against llama.cpp",
        "`benchmarks/moe_speed.py`: a random Qwen3-MoE-shaped model (24 layers) as a bf16 "
        "GGUF in loom and llama.cpp, decode at batch 1 and 8.")
    # moe_speed.json was recorded on the Intel VM (its page, moe_speed.md)
    for name in _files("moe_speed.json"):
        data = _load(name)
        s = data["summary"]
        for batch in ("1", "8"):
            section.rows.append(Row(f"MoE decode, batch {batch}", "llama.cpp", s[f"moe_over_llama_cpp_b{batch}"],
                                    None, MACHINES["intel"], name,
                                    f"python benchmarks/moe_speed.py --layers {data['args']['layers']}",
                                    f"{s[f'moe_b{batch}']:.1f} vs {s[f'llama_cpp_moe_b{batch}']:.1f} tok/s"))
    return section


def cuda() -> Section:
    section = Section(
        "On a GPU",
        "`benchmarks/cuda_speed.py` on one H200: decode with loom's CUDA path (decode steps "
        "replayed from CUDA graphs) against transformers' generate on the same GPU, bf16. "
        "This is the only GPU run loom has; the Triton kernels have never run on a GPU.")
    section.notes.append(
        "Read these ratios as indicative: transformers' own decode step moved 2-3x within "
        "that run (37-47 ms beside one engine, 11-13 ms beside the other), so they measure "
        "its drift as much as loom's speed. loom's step times beside the roofline "
        "(benchmarks/cuda.md) are the steadier figures.")
    for name in _files("cuda_speed-*.json"):
        data = _load(name)
        for shape in data["shapes"]:
            for result in shape["engines"]["loom"]["results"]:
                section.rows.append(Row(
                    f"{shape['shape']}, batch {result['batch_size']}", "transformers",
                    result["loom_over_transformers_decode"], None, MACHINES["h200"], name,
                    "bash benchmarks/cuda_check.sh", f"{result['loom']['decode_tokens_per_s']:,.0f} tok/s, "
                    f"step {result['loom']['decode_step_ms']} ms"))
    return section


SECTIONS = (decode_against_llamacpp, served_against_llama_server, quantized_prompt,
            default_model_against_engines, long_prompts, lora, embeddings, kv_tier, vision,
            image_transport, perplexity, kv_cache_accuracy, moe, cuda)

# The results files the sections above read (globs), to find the ones nothing reads.
READ = ("interleaved-*.json", "served-*.json", "quantized-*.json", "summary.json",
        "long-context-*.json", "lora-*.json", "embed-speed-*.json", "kv_tier*.json",
        "vision-speed-*.json", "mm-transport-*.json", "perplexity-*.json", "kv-perplexity-*.json", "moe_speed.json", "cuda_speed-*.json",
        "cuda_speed_file-*.json")


def unaccounted() -> list[str]:
    """Files in results/ that no section reads and UNREAD does not name."""
    import fnmatch

    patterns = list(READ) + list(UNREAD)
    return [name for name in sorted(os.listdir(RESULTS))
            if not any(fnmatch.fnmatch(name, p) for p in patterns)]


# -- rendering ---------------------------------------------------------------------------

# Pairs whose ratios differ by more than this factor say more about the host than about
# either engine: the figure is marked, and should be measured again on a quieter host.
UNSTEADY = 1.5


def _ratio(row: Row) -> str:
    text = f"**{row.ratio:.{row.digits}f}x**"
    if row.spread:
        text += f" ({row.spread[0]:.2f}-{row.spread[1]:.2f}"
        text += ", unsteady)" if row.spread[1] > UNSTEADY * row.spread[0] else ")"
    return text


def render(sections: list[Section]) -> str:
    lines = [
        "# Results",
        "",
        "Generated by `python benchmarks/make_results.py` from the JSON in",
        "[results/](results/); do not edit by hand. Every figure is loom's ratio to a baseline",
        "run beside it on the same machine (above 1: loom faster, or for perplexity, worse),",
        "with its spread over pairs or repeats where the file has them (\"unsteady\": the",
        f"pairs differ by more than {UNSTEADY}x, so the host moved more than the engines did;",
        "such a figure wants measuring again). Date and commit are",
        "those that recorded the file. How each is measured: [README.md](README.md) and the",
        "method pages beside this one. Machines:",
        "",
    ]
    used = {row.machine for s in sections for row in s.rows}
    lines += [f"- {text}" for text in MACHINES.values() if text in used]
    lines += [f"- {text}" for text in sorted(used - set(MACHINES.values()))]
    lines.append("")
    for section in sections:
        if not section.rows:
            continue
        anchor = section.title
        lines += [f"## {anchor}", "", section.intro, ""]
        if section.plot and os.path.exists(os.path.join(RESULTS, section.plot)):
            lines += [f"![{section.title}](results/{section.plot})", ""]
        by_machine: dict[str, list[Row]] = {}
        for row in section.rows:
            by_machine.setdefault(row.machine, []).append(row)
        for machine, rows in by_machine.items():
            where = "On " + (machine if machine.startswith("one ") else f"a {machine}")
            lines += [f"{where}:" if machine != "not recorded" else "Machine not recorded:", "",
                      "| comparison | loom / baseline | baseline | detail | recorded | file |",
                      "|---|---|---|---|---|---|"]
            for row in rows:
                date, commit = _git_origin(row.source)
                lines.append(f"| {row.what} | {_ratio(row)} | {row.baseline} | {row.detail} | "
                             f"{date} {commit} | [{row.source}](results/{row.source}) |")
            lines.append("")
        commands = sorted({row.command for row in section.rows})
        lines += ["Commands:", "", "```bash"] + commands + ["```", ""]
        lines += [note + "\n" for note in section.notes]
    return "\n".join(lines).rstrip() + "\n"


def _pick(sections: list[Section], source: str, what: str = "") -> Row | None:
    for section in sections:
        for row in section.rows:
            if row.source == source and row.what.startswith(what):
                return row
    return None


def _ratios(rows: list[Row | None]) -> str:
    rows = [r for r in rows if r is not None]
    if not rows:
        return "-"
    if len(rows) == 1:
        return _ratio(rows[0]).replace("**", "")
    return f"{min(r.ratio for r in rows):.2f}-{max(r.ratio for r in rows):.2f}x (two runs)"


def readme_summary(sections: list[Section]) -> str:
    """The README's table: the newest machine's decode ratios against llama.cpp, then one
    line per other comparison, each the ratio as RESULTS.md gives it."""
    zen5 = MACHINES["zen5"]
    lines = [SUMMARY_BEGIN,
             f"On a {zen5}: loom's speed over the baseline's,",
             "run beside it (above 1: loom faster); in brackets the spread over the pairs",
             f"(\"unsteady\": they differ by more than {UNSTEADY}x, to be measured again). Memory,",
             "dates, commits and commands in",
             "[benchmarks/RESULTS.md](benchmarks/RESULTS.md).",
             "",
             "| decode against llama.cpp, same GGUF file | batch 1 | batch 8 | batch 32 |",
             "|---|---|---|---|"]
    for model, fmt, label in (("default", "q4_1", "SmolLM2-135M (the default), Q4_1"),
                              ("1b", "q4_0", "1B-class Llama, Q4_0"),
                              ("1b", "q4_k_m", "1B-class Llama, Q4_K_M"),
                              ("1b", "q8_0", "1B-class Llama, Q8_0"),
                              ("1b", "bf16", "1B-class Llama, bf16")):
        cells = []
        for batch in (1, 8, 32):
            stem = f"interleaved-zen5-{model}-{fmt}-b{batch}"
            cells.append(_ratios([_pick(sections, f"{stem}.json")]
                                 + [_pick(sections, f"{stem}-run{i}.json") for i in (1, 2)]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| other comparisons | loom / baseline |", "|---|---|"]
    others = (
        ("default file served to 32 clients, against llama-server", "served-zen5-default.json", "default Q4_1, 32"),
        ("16,384-token prompt, 1B Q4_0: first token / decode after it, against llama.cpp",
         "long-context-16k-zen5.json", ""),
        ("LoRA adapter, batch-1 decode, against llama-server --lora", "lora-gguf-llamacpp-llama1b-zen5.json", ""),
        ("embeddings, SmolLM2-135M, against sentence-transformers", "embed-speed-smollm2-zen5.json", ""),
        ("image in (Qwen2.5-VL 1B-class): first token / decode, against llama.cpp",
         "vision-speed-qwen2_5_vl-1b-zen5.json", ""),
    )
    for label, source, what in others:
        rows = [r for s in sections for r in s.rows if r.source == source and r.what.startswith(what)
                and r.baseline.startswith(("llama", "sentence"))]
        if source.startswith(("long-context", "vision")):
            rows = [r for r in rows if "first token" in r.what or r.what.endswith(("decode", "decode after it"))]
            text = " / ".join(f"{r.ratio:.2f}x" for r in rows)
        else:
            text = _ratios(rows[:1])
        lines.append(f"| {label} | {text} |")
    engines = _load("summary.json").get("machine", {})
    for baseline, label in (("vllm", "vLLM's CPU build"), ("transformers", "transformers")):
        rows = [r for s in sections for r in s.rows if r.source == "summary.json" and r.baseline == baseline
                and r.what in ("offline output tok/s, batch 1", "offline output tok/s, batch 32")]
        lines.append(f"| default model in bf16, offline batch 1 / 32, against {label} "
                     f"({engines.get('cpus', 2)}-core AMD EPYC VM) | "
                     + " / ".join(f"{r.ratio:.2f}x" for r in rows) + " |")
    lines += ["", "![decode against llama.cpp](benchmarks/results/plots/decode-vs-llamacpp.png)", SUMMARY_END]
    return "\n".join(lines)


def _with_summary(readme: str, summary: str) -> str:
    if SUMMARY_BEGIN not in readme or SUMMARY_END not in readme:
        return readme
    head, rest = readme.split(SUMMARY_BEGIN, 1)
    return head + summary + rest.split(SUMMARY_END, 1)[1]


def plot_decode(section: Section) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machines = [m for m in MACHINES.values() if any(r.machine == m for r in section.rows)]
    fig, axes = plt.subplots(len(machines), 1, figsize=(8, 2.2 * len(machines)), squeeze=False)
    colors = {"1": "#4c72b0", "8": "#dd8452", "32": "#55a868"}
    for ax, machine in zip(axes[:, 0], machines):
        rows = [r for r in section.rows if r.machine == machine and "run2" not in r.detail]
        labels = sorted({r.what for r in rows}, key=lambda w: (not w.startswith("default"), w))
        for offset, batch in enumerate(("1", "8", "32")):
            xs, ys, errs = [], [], [[], []]
            for i, label in enumerate(labels):
                for r in rows:
                    if r.what == label and re.search(rf"batch {batch},", r.detail):
                        xs.append(i + (offset - 1) * 0.27)
                        ys.append(r.ratio)
                        low, high = r.spread or (r.ratio, r.ratio)
                        errs[0].append(r.ratio - low)
                        errs[1].append(high - r.ratio)
            ax.bar(xs, ys, width=0.27, color=colors[batch], label=f"batch {batch}",
                   yerr=errs, capsize=2, error_kw={"elinewidth": 0.6})
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([w.replace(" (from the ", "\n(").replace(" file)", ")").replace(", one thread each", "\n1 thread")
                            for w in labels], fontsize=6)
        ax.set_ylabel("loom / llama.cpp", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(machine, fontsize=8)
    axes[0, 0].legend(fontsize=6, ncol=3, loc="upper right")
    fig.tight_layout()
    os.makedirs(PLOTS, exist_ok=True)
    fig.savefig(os.path.join(RESULTS, section.plot), dpi=72)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if RESULTS.md differs from what would be written, or a "
                             "results file is neither read nor named in UNREAD")
    args = parser.parse_args()
    missing = unaccounted()
    if missing:
        print("make_results: results files no section reads (add a section, or name them in "
              f"UNREAD with the reason): {', '.join(missing)}", file=sys.stderr)
        return 1
    sections = [build() for build in SECTIONS]
    page = render(sections)
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    new_readme = _with_summary(readme, readme_summary(sections))
    if args.check:
        with open(PAGE, encoding="utf-8") as f:
            if f.read() != page or new_readme != readme:
                print("make_results: benchmarks/RESULTS.md or README.md's summary is stale; run "
                      "python benchmarks/make_results.py", file=sys.stderr)
                return 1
        return 0
    try:
        plot_decode(sections[0])
    except ImportError:
        print("make_results: matplotlib is not installed; the page is written without new plots")
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(page)
    with open(README, "w", encoding="utf-8") as f:
        f.write(new_readme)
    print(f"make_results: wrote {os.path.relpath(PAGE)} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
