"""``loom serve`` flags beyond the engine's, in vLLM's spelling. No heavy imports here:
the parser is built for every ``loom`` command."""

from __future__ import annotations

import argparse

from loom.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    group.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model's file or "
                            "directory name)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    group.add_argument("--max-num-waiting", type=_non_negative_int, default=None,
                       help="sequences allowed to wait beyond --max-num-seqs; more get 503 "
                            "with Retry-After (default: no limit)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let requests in flight finish (new ones "
                            "get 503) before aborting them and exiting")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="do not log each request")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                       help="how to find tool calls in the model's text for tool_choice auto")
    group.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                       help="split <think>...</think> into reasoning_content in chat responses")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value
