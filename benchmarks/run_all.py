"""Run loom and every available baseline side by side, interleaved and repeated.

    python benchmarks/run_all.py                 # full run, about 12-15 minutes on 2 cores
    python benchmarks/run_all.py --quick         # smaller runs, one repeat (a few minutes)
    python benchmarks/run_all.py --engines loom,llamacpp --repeats 5

Per repeat, in an order rotated each repeat (so no engine always runs first or last):

- offline, 128-token prompts, 128 new tokens, batch 1, 8, 32 (bf16, greedy, fixed
  output lengths): ``loom bench latency``, transformers ``generate``
  (baseline_transformers.py), vLLM CPU ``LLM.generate`` (baseline_vllm_offline.py),
  llama.cpp ``llama-batched-bench`` and ``llama-bench`` (pp128, tg128);
- serving over HTTP at ``--concurrency`` 1, 8, 32: ``loom serve``, ``llama-server`` and
  vLLM's OpenAI server, each started, loaded with ``loom bench serve`` and stopped.

Once: the roofline (bandwidth, weight bytes per step) and, unless ``--skip-mixed``, 256
mixed-length requests offline (loom, vLLM, transformers static batches of 32).

Results: ``--out`` (default benchmarks/results/) gets raw/*.json for every
measurement, summary.json (medians over repeats), summary.md (the tables) and
plot.png (via plot_results.py). Everything is bounded: each step has a timeout and
a repeat starts only if it should end within ``--budget-min``, and at budget +
``--grace-s`` whatever still runs is stopped and the rest skipped (noted in summary.md).

Every engine loads the same weights: the default GGUF dequantized to a bf16 Hugging
Face directory (make_hf_model.py); llama.cpp gets that converted to a BF16 GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENGINES = ("loom", "transformers", "vllm", "llamacpp")
SERVERS = ("loom", "llamacpp", "vllm")


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = args.out
        self.raw = os.path.join(self.out, "raw")
        os.makedirs(self.raw, exist_ok=True)
        self.started = time.monotonic()
        self.log = open(os.path.join(self.out, "run_all.log"), "a")
        self.envs = args.bench_envs
        self.hf_model = os.path.join(self.envs, "models", "smollm2-135m-bf16")
        self.gguf_bf16 = os.path.join(self.envs, "models", "smollm2-135m-bf16.gguf")
        self.llama_bin = os.path.join(self.envs, "llama.cpp", "bin")
        self.vllm_python = os.path.join(self.envs, "vllm", "bin", "python")
        self.notes: list[str] = []

    # ------------------------------------------------------------- plumbing

    def say(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def remaining_s(self) -> float:
        """Seconds left before the hard stop: the budget plus --grace-s."""
        return (self.args.budget_min * 60 + self.args.grace_s
                - (time.monotonic() - self.started))

    def run(self, name: str, command: list[str], timeout: float, env: dict | None = None) -> bool:
        if self.remaining_s() < 20:
            self.note(f"{name} skipped: past the {self.args.budget_min}-minute budget")
            return False
        timeout = min(timeout, self.remaining_s())
        self.say(f"{name}: {' '.join(command)}")
        with open(os.path.join(self.raw, f"{name}.log"), "w") as log:
            # Own session, so a timeout stops the whole tree (vLLM's engine and workers).
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                self.note(f"{name} timed out after {timeout:.0f} s")
                return False
        if proc.returncode != 0:
            self.note(f"{name} exited with {proc.returncode}; see raw/{name}.log")
            return False
        return True

    def note(self, message: str) -> None:
        self.say("NOTE " + message)
        self.notes.append(message)

    def over_budget(self) -> bool:
        return time.monotonic() - self.started > self.args.budget_min * 60

    def available(self, engine: str) -> bool:
        if engine not in self.args.engines:
            return False
        if engine == "vllm":
            return os.path.exists(self.vllm_python)
        if engine == "llamacpp":
            return os.path.exists(os.path.join(self.llama_bin, "llama-server"))
        return True

    # ------------------------------------------------------------- preparation

    def prepare(self) -> None:
        if not os.path.exists(os.path.join(self.hf_model, "config.json")):
            self.run("make_hf_model", [sys.executable, os.path.join(HERE, "make_hf_model.py"),
                                       self.hf_model], timeout=600)
        if self.available("llamacpp") and not os.path.exists(self.gguf_bf16):
            # Requantize the shipped Q4_1 to BF16: the same dequantized weights as the
            # HF directory, rounded to bf16 the same way.
            from loom.default_model import default_model_path

            self.run("llama_quantize", [os.path.join(self.llama_bin, "llama-quantize"),
                                        "--allow-requantize", default_model_path(),
                                        self.gguf_bf16, "BF16"], timeout=300)
        for engine in ENGINES:
            if engine in self.args.engines and not self.available(engine):
                self.note(f"{engine} is not installed under {self.envs}; skipped "
                          "(see benchmarks/README.md to build it)")
        self.write_prompts()
        self.run("roofline", [sys.executable, os.path.join(HERE, "roofline.py"), "--model",
                              self.hf_model, "--result-file",
                              os.path.join(self.raw, "roofline.json")], timeout=120)

    def write_prompts(self) -> None:
        """The static and mixed prompt sets as token ids, for the vLLM script."""
        from transformers import AutoTokenizer

        from loom.bench.datasets import random_requests

        tokenizer = AutoTokenizer.from_pretrained(self.hf_model)
        a = self.args
        static = random_requests(max(a.batch_sizes) * 2, a.input_len, a.output_len,
                                 tokenizer=tokenizer, seed=0)
        mixed = random_requests(a.mixed_num_prompts, a.mixed_input_len, a.mixed_output_len,
                                a.mixed_range_ratio, tokenizer=tokenizer, seed=0)
        self.prompts_file = os.path.join(self.out, "prompts.json")
        with open(self.prompts_file, "w") as f:
            json.dump({"static": [r.prompt_token_ids for r in static],
                       "mixed": [{"prompt_token_ids": r.prompt_token_ids,
                                  "output_len": r.output_len} for r in mixed]}, f)

    # ------------------------------------------------------------- offline

    def offline(self, engine: str, rep: int) -> None:
        a = self.args
        sizes = [str(b) for b in a.batch_sizes]
        result = os.path.join(self.raw, f"offline-{engine}-r{rep}.json")
        if engine == "loom":
            self.run(f"offline-loom-r{rep}", [
                sys.executable, "-m", "loom.cli", "bench", "latency", "--model", self.hf_model,
                "--dtype", "bfloat16", "--batch-size", *sizes, "--input-len", str(a.input_len),
                "--output-len", str(a.output_len), "--num-iters", "1",
                "--num-iters-warmup", "1", "--kv-cache-memory", "1GiB",
                "--max-model-len", "2048", "--result-file", result], timeout=600)
        elif engine == "transformers":
            self.run(f"offline-transformers-r{rep}", [
                sys.executable, os.path.join(HERE, "baseline_transformers.py"),
                "--model", self.hf_model, "--batch-sizes", *sizes,
                "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                "--iters", "1", "--warmup", "1", "--result-file", result], timeout=600)
        elif engine == "llamacpp":
            self.llamacpp_offline(rep, result)

    def llamacpp_offline(self, rep: int, result: str) -> None:
        a = self.args
        batched = os.path.join(self.raw, f"offline-llamacpp-batched-r{rep}.log")
        ok = self.run(f"offline-llamacpp-batched-r{rep}", [
            os.path.join(self.llama_bin, "llama-batched-bench"), "-m", self.gguf_bf16,
            "-c", str(max(a.batch_sizes) * (a.input_len + a.output_len) + 256),
            "-b", "2048", "-ub", "512", "-npp", str(a.input_len), "-ntg", str(a.output_len),
            "-npl", ",".join(str(b) for b in a.batch_sizes), "-t", str(a.threads),
            "--output-format", "jsonl"], timeout=600)
        rows = []
        if ok:
            with open(batched) as f:
                for line in f:
                    if line.startswith("{"):
                        row = json.loads(line)
                        rows.append({"batch_size": row["pl"],
                                     "prefill_tokens_per_s": row["speed_pp"],
                                     "decode_tokens_per_s": row["speed_tg"],
                                     "median_e2e_s": row["t"],
                                     "output_tokens_per_s": row["pl"] * row["tg"] / row["t"]})
        bench_log = os.path.join(self.raw, f"offline-llamacpp-bench-r{rep}.log")
        ok = self.run(f"offline-llamacpp-bench-r{rep}", [
            os.path.join(self.llama_bin, "llama-bench"), "-m", self.gguf_bf16,
            "-p", str(a.input_len), "-n", str(a.output_len), "-t", str(a.threads), "-r", "2",
            "-o", "json"], timeout=300)
        single = {}
        if ok:
            with open(bench_log) as f:
                text = f.read()
            for test in json.loads(text[text.index("["):text.rindex("]") + 1]):
                kind = "prefill_tokens_per_s" if test["n_prompt"] else "decode_tokens_per_s"
                single[kind] = test["avg_ts"]
        with open(result, "w") as f:
            json.dump({"engine": "llamacpp", "results": rows, "llama_bench": single}, f,
                      indent=2)

    # ------------------------------------------------------------- serving

    def vllm_env(self) -> dict[str, str]:
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{self.args.threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": "1"}

    def server_command(self, engine: str, port: int) -> tuple[list[str], dict[str, str]]:
        a = self.args
        if engine == "loom":
            return [sys.executable, "-m", "loom.cli", "serve", self.hf_model, "--port", str(port),
                    "--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--max-model-len",
                    "2048", "--served-model-name", "smollm2", "--disable-log-requests"], {}
        if engine == "llamacpp":
            slots = max(a.concurrency)
            return [os.path.join(self.llama_bin, "llama-server"), "-m", self.gguf_bf16,
                    "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                    "-np", str(slots), "-c", str(slots * 2 * (a.input_len + a.output_len)),
                    "--alias", "smollm2", "--no-webui"], {}
        return [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.hf_model, "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
                "2048", "--max-num-seqs", str(max(a.concurrency)), "--served-model-name",
                "smollm2"], self.vllm_env()  # vLLM 0.32 logs no requests by default

    def start_servers(self, engines: list[str]) -> dict[str, tuple[subprocess.Popen, int]]:
        procs: dict[str, tuple[subprocess.Popen, int]] = {}
        for engine in engines:
            port = _free_port()
            command, env = self.server_command(engine, port)
            name = f"server-{engine}"
            self.say(f"{name}: {' '.join(command)}")
            log = open(os.path.join(self.raw, f"{name}.log"), "w")
            started = time.monotonic()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, **env}, start_new_session=True)
            log.close()
            timeout = min(self.args.server_start_timeout, max(self.remaining_s() - 60, 0))
            if self.wait_ready(port, proc, timeout=timeout):
                self.say(f"{name} ready after {time.monotonic() - started:.1f} s")
                procs[engine] = (proc, port)
            else:
                self.note(f"{name} did not become ready; see raw/{name}.log")
                _stop(proc)
        return procs

    def serving(self, engine: str, rep: int) -> None:
        port = self.server_ports[engine]
        for concurrency in self.args.concurrency:
            num_prompts = max(self.args.min_prompts, concurrency * self.args.prompts_per_slot)
            name = f"serve-{engine}-c{concurrency}-r{rep}"
            self.run(name, [
                sys.executable, "-m", "loom.cli", "bench", "serve",
                "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2",
                "--tokenizer", self.hf_model, "--num-prompts", str(num_prompts),
                "--random-input-len", str(self.args.input_len),
                "--random-output-len", str(self.args.output_len),
                "--max-concurrency", str(concurrency), "--num-warmups", "2",
                "--seed", str(rep), "--disable-tqdm", "--label", engine,
                "--result-file", os.path.join(self.raw, f"{name}.json")], timeout=600)

    def wait_ready(self, port: int, proc: subprocess.Popen, timeout: float) -> bool:
        return wait_ready(port, proc, timeout)

    # ------------------------------------------------------------- mixed lengths

    def vllm_offline(self) -> None:
        a = self.args
        self.run("offline-vllm-r0", [
            self.vllm_python, os.path.join(HERE, "baseline_vllm_offline.py"),
            "--model", self.hf_model, "--prompts", self.prompts_file,
            "--batch-sizes", *[str(b) for b in a.batch_sizes], "--output-len",
            str(a.output_len), "--iters", str(a.repeats), *([] if a.skip_mixed else ["--mixed"]),
            "--result-file", os.path.join(self.raw, "offline-vllm-r0.json")],
            timeout=900, env=self.vllm_env())

    def mixed(self) -> None:
        a = self.args
        if self.available("loom"):
            self.run("mixed-loom", [
                sys.executable, "-m", "loom.cli", "bench", "throughput", "--model", self.hf_model,
                "--dtype", "bfloat16", "--num-prompts", str(a.mixed_num_prompts),
                "--input-len", str(a.mixed_input_len), "--output-len", str(a.mixed_output_len),
                "--random-range-ratio", str(a.mixed_range_ratio), "--max-num-seqs", "256",
                "--kv-cache-memory", "1GiB", "--max-model-len", "2048", "--disable-tqdm",
                "--result-file", os.path.join(self.raw, "mixed-loom.json")], timeout=900)
        if self.available("transformers"):
            self.run("mixed-transformers", [
                sys.executable, os.path.join(HERE, "baseline_transformers.py"), "--mode", "mixed",
                "--model", self.hf_model, "--num-prompts", str(a.mixed_num_prompts),
                "--batch-size", "32", "--input-len", str(a.mixed_input_len),
                "--output-len", str(a.mixed_output_len), "--range-ratio",
                str(a.mixed_range_ratio), "--result-file",
                os.path.join(self.raw, "mixed-transformers.json")], timeout=900)

    # ------------------------------------------------------------- the run

    def main(self) -> None:
        a = self.args
        self.say(f"run_all: engines {','.join(a.engines)}, {a.repeats} repeats, budget "
                 f"{a.budget_min} min, out {self.out}")
        self.prepare()
        offline = [e for e in ENGINES if self.available(e) and e != "vllm"]
        servers = [e for e in SERVERS if self.available(e)]
        reserve_s = 0 if a.skip_mixed or "mixed" not in a.phases else a.mixed_reserve_s
        # Offline: half the budget at most. vLLM takes a minute or more to start (it
        # compiles), so its offline run happens once, with its iterations inside, and
        # carries the mixed-length set too.
        done = served = 0
        if "offline" in a.phases:
            done = self.repeat("offline", offline, self.offline, a.budget_min * 60 * 0.45)
            if self.available("vllm"):
                self.vllm_offline()
        if "serving" in a.phases:
            # Every server up at once (idle ones sleep), clients interleaved.
            procs = self.start_servers(servers)
            self.server_ports = {engine: port for engine, (_, port) in procs.items()}
            try:
                served = self.repeat("serving", list(procs), self.serving,
                                     a.budget_min * 60 - reserve_s)
            finally:
                for proc, _ in procs.values():
                    _stop(proc)
        if "mixed" in a.phases and not a.skip_mixed:
            self.mixed()
        self.report({"notes": self.notes, "repeats_done": {"offline": done, "serving": served},
                     "wall_min": (time.monotonic() - self.started) / 60,
                     "machine": machine_info(), "label": a.label})
        self.say(f"done in {(time.monotonic() - self.started) / 60:.1f} min")

    def report(self, extra: dict[str, Any]) -> None:
        """summary.json, summary.md and plot.png from raw/ (``--report-only`` redoes this)."""
        summary = {**summarize(self.raw), **extra}
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        # Through JSON and back, so a --report-only run renders exactly the same.
        with open(os.path.join(self.out, "summary.json")) as f:
            markdown = render_markdown(json.load(f))
        with open(os.path.join(self.out, "summary.md"), "w") as f:
            f.write(markdown)
        print(markdown)
        # matplotlib lives in the bench-envs "tools" venv, not in loom's environment.
        plot_python = os.path.join(self.envs, "tools", "bin", "python")
        subprocess.run([plot_python if os.path.exists(plot_python) else sys.executable,
                        os.path.join(HERE, "plot_results.py"),
                        os.path.join(self.out, "summary.json")], cwd=REPO)

    def repeat(self, phase: str, engines: list[str], step, deadline_s: float) -> int:
        """Up to --repeats rounds over ``engines`` (order rotated each round); a round
        starts only if one more, as long as the longest so far, ends by ``deadline_s``."""
        longest = 0.0
        for rep in range(self.args.repeats):
            elapsed = time.monotonic() - self.started
            if rep and elapsed + longest > deadline_s:
                self.note(f"{phase}: stopped after {rep} repeats to stay within the "
                          f"{self.args.budget_min}-minute budget")
                return rep
            started = time.monotonic()
            for engine in _rotate(engines, rep):
                step(engine, rep)
            longest = max(longest, time.monotonic() - started)
        return self.args.repeats

# ----------------------------------------------------------------- summary


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(raw: str) -> dict[str, Any]:
    """Medians over repeats: offline[engine][batch][metric], serving[engine][conc][metric]."""
    offline: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    single: dict = defaultdict(lambda: defaultdict(list))
    serving: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    mixed: dict[str, Any] = {}
    roofline = None
    for name in sorted(os.listdir(raw)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(raw, name)) as f:
            record = json.load(f)
        if name == "roofline.json":
            roofline = record
        elif name.startswith("offline-"):
            engine = name.split("-")[1]
            for row in record.get("results", []):
                for key in ("output_tokens_per_s", "decode_tokens_per_s",
                            "prefill_tokens_per_s", "median_prefill_s", "median_decode_step_s"):
                    if row.get(key) is not None:
                        offline[engine][row["batch_size"]][key].append(row[key])
            for key, value in record.get("llama_bench", {}).items():
                single[engine][key].append(value)
            if "mixed" in record:
                mixed[engine] = record["mixed"]
        elif name.startswith("serve-"):
            _, engine, conc, _ = name[:-5].split("-")
            for key in ("output_throughput", "request_throughput", "median_ttft_ms",
                        "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                        "p99_itl_ms", "median_e2el_ms", "completed", "failed",
                        "requests_with_other_output_len"):
                serving[engine][int(conc[1:])][key].append(record.get(key))
        elif name.startswith("mixed-"):
            engine = name[6:-5]
            mixed[engine] = record

    def medians(tree):
        return {k: medians(v) if isinstance(v, dict) else _median(v) for k, v in tree.items()}

    def counts(tree):
        return {e: {b: len(next(iter(m.values()))) for b, m in per.items()}
                for e, per in tree.items()}

    return {"offline": medians(offline), "offline_repeats": counts(offline),
            "llama_bench": medians(single), "serving": medians(serving),
            "serving_repeats": counts(serving), "mixed": mixed, "roofline": roofline}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def render_markdown(s: dict[str, Any]) -> str:
    lines = []
    offline, serving = s["offline"], s["serving"]
    batches = sorted({str(b) for per in offline.values() for b in per}, key=int)
    offline = {e: {str(b): m for b, m in per.items()} for e, per in offline.items()}
    serving = {e: {str(c): m for c, m in per.items()} for e, per in serving.items()}
    engines = [e for e in ENGINES if e in offline]
    if batches:
        lines += ["### Offline: output tokens/s (128 in, 128 out, incl. prefill; median of "
                  "repeats)", "", "| engine | " + " | ".join(f"batch {b}" for b in batches)
                  + " | loom ÷ engine (per batch) |",
                  "|---|" + "---|" * len(batches) + "---|"]
        for engine in engines:
            cells = [_fmt(offline[engine].get(b, {}).get("output_tokens_per_s")) for b in batches]
            ratios = [_ratio(offline.get("loom", {}).get(b, {}).get("output_tokens_per_s"),
                             offline[engine].get(b, {}).get("output_tokens_per_s"))
                      for b in batches]
            lines.append(f"| {engine} | " + " | ".join(cells) + " | "
                         + (" / ".join(ratios) if engine != "loom" else "") + " |")
        lines += ["", "### Offline: decode tokens/s (steady state) and prefill tokens/s", "",
                  "| engine | " + " | ".join(f"decode b{b}" for b in batches)
                  + " | prefill (b1, 128 tokens) |", "|---|" + "---|" * len(batches) + "---|"]
        for engine in engines:
            cells = [_fmt(offline[engine].get(b, {}).get("decode_tokens_per_s"))
                     for b in batches]
            prefill = offline[engine].get(batches[0], {}).get("prefill_tokens_per_s")
            lines.append(f"| {engine} | " + " | ".join(cells) + f" | {_fmt(prefill, 0)} |")
        if s.get("llama_bench"):
            lb = s["llama_bench"].get("llamacpp", {})
            lines += ["", f"llama-bench (batch 1): pp128 {_fmt(lb.get('prefill_tokens_per_s'), 0)}"
                      f" tok/s, tg128 {_fmt(lb.get('decode_tokens_per_s'))} tok/s."]
    concs = sorted({c for per in serving.values() for c in per}, key=int)
    if concs:
        lines += ["", "### Serving over HTTP (`loom bench serve`, 128 in / 128 out, "
                  "ignore_eos): output tok/s | median TPOT ms | p99 TPOT ms | median TTFT ms",
                  "", "| server | " + " | ".join(f"c={c}" for c in concs) + " |",
                  "|---|" + "---|" * len(concs)]
        for engine in [e for e in SERVERS if e in serving]:
            cells = []
            for c in concs:
                m = serving[engine].get(c, {})
                if not m or not m.get("completed"):
                    cells.append("all failed" if m else "–")
                    continue
                failed = f" ({m['failed']:g} failed)" if m.get("failed") else ""
                cells.append(f"{_fmt(m.get('output_throughput'))} · {_fmt(m.get('median_tpot_ms'))}"
                             f" · {_fmt(m.get('p99_tpot_ms'))} · {_fmt(m.get('median_ttft_ms'), 0)}"
                             + failed)
            lines.append(f"| {engine} | " + " | ".join(cells) + " |")
        if "loom" in serving:
            for engine in [e for e in SERVERS if e in serving and e != "loom"]:
                ratios = [_ratio(serving["loom"].get(c, {}).get("output_throughput"),
                                 serving[engine].get(c, {}).get("output_throughput"))
                          for c in concs]
                lines.append(f"| loom ÷ {engine} (tok/s) | " + " | ".join(ratios) + " |")
    if s.get("mixed"):
        lines += ["", "### Mixed lengths offline (one run)", "",
                  "| engine | requests | output tokens | seconds | output tok/s | loom ÷ engine |",
                  "|---|---|---|---|---|---|"]
        loom_rate = s["mixed"].get("loom", {}).get("output_tokens_per_s")
        for engine, m in s["mixed"].items():
            rate = m.get("output_tokens_per_s")
            ratio = _ratio(loom_rate, rate) if engine != "loom" else ""
            lines.append(f"| {engine} | {m.get('num_prompts')} | {m.get('total_output_tokens')} "
                         f"| {_fmt(m.get('elapsed_s'))} | {_fmt(rate)} | {ratio} |")
    roof = s.get("roofline")
    if roof:
        lines += ["", f"Roofline: {roof['weight_bytes_per_step'] / 1e6:.0f} MB of bf16 weights "
                  f"per decode step ÷ {roof['bandwidth_used_gb_s']:.1f} GB/s measured "
                  f"(copy {roof['copy_gb_s']:.1f}, read {roof['read_gb_s']:.1f}) = "
                  f"{roof['decode_step_floor_ms']:.1f} ms per step, at most "
                  f"{roof['batch1_decode_ceiling_tok_s']:.0f} tok/s at batch 1."]
        loom_b1 = offline.get("loom", {}).get("1", {}).get("decode_tokens_per_s")
        if loom_b1:
            lines.append(f"loom batch-1 decode: {loom_b1:.1f} tok/s = "
                         f"{loom_b1 / roof['batch1_decode_ceiling_tok_s']:.0%} of that roofline.")
    if s.get("notes"):
        lines += ["", "Notes:"] + [f"- {n}" for n in s["notes"]]
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}x"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        info["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass
    return info


def _rotate(items: list[str], n: int) -> list[str]:
    if not items:
        return items
    n %= len(items)
    return items[n:] + items[:n]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float,
               interval_s: float = 1.0) -> bool:
    """Whether the OpenAI server ``proc`` on ``port`` lists its models within ``timeout``
    seconds (False at once if it exits)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it was started in its own session), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--bench-envs", default=os.environ.get("LOOM_BENCH_ENVS",
                                                                "/work/bench-envs"))
    parser.add_argument("--engines", default=",".join(ENGINES),
                        type=lambda s: [e for e in s.split(",") if e])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", default="offline,serving,mixed",
                        type=lambda s: [p for p in s.split(",") if p],
                        help="which phases to run; results merge into --out/raw unless --clean")
    parser.add_argument("--budget-min", type=float, default=13.0,
                        help="minutes; a repeat starts only if it should end in time")
    parser.add_argument("--grace-s", type=float, default=90,
                        help="hard stop this long after the budget: running steps are killed, "
                             "later ones skipped (noted in the summary)")
    parser.add_argument("--mixed-reserve-s", type=float, default=180,
                        help="seconds kept at the end of the budget for the mixed-length runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-slot", type=int, default=2,
                        help="serving: requests = concurrency x this (at least --min-prompts)")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--server-start-timeout", type=float, default=300)
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--mixed-num-prompts", type=int, default=256)
    parser.add_argument("--mixed-input-len", type=int, default=64)
    parser.add_argument("--mixed-output-len", type=int, default=64)
    parser.add_argument("--mixed-range-ratio", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true",
                        help="one repeat, batch/concurrency 1 and 8, 64 mixed prompts")
    parser.add_argument("--label", default="", help="e.g. 'machine shared, noisy'")
    parser.add_argument("--clean", action="store_true", help="empty --out/raw first")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: rebuild summary and plot from --out/raw")
    args = parser.parse_args()
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if args.quick:
        args.repeats, args.batch_sizes, args.concurrency = 1, [1, 8], [1, 8]
        args.mixed_num_prompts = 64
    if args.clean and os.path.isdir(os.path.join(args.out, "raw")):
        shutil.rmtree(os.path.join(args.out, "raw"))
    runner = Runner(args)
    if args.report_only:
        previous = {}
        path = os.path.join(args.out, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                previous = json.load(f)
        keep = ("notes", "repeats_done", "wall_min", "machine", "label")
        runner.report({k: previous[k] for k in keep if k in previous}
                      | ({"label": args.label} if args.label else {}))
        return
    runner.main()


if __name__ == "__main__":
    main()
