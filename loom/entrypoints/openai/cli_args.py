"""``loom serve`` flags beyond the engine's, in vLLM's spelling. No heavy imports here:
the parser is built for every ``loom`` command."""

from __future__ import annotations

import argparse
import json
import os
import ssl

from loom import arg_types
from loom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from loom.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    group.add_argument("--port", type=arg_types.port, default=8000, help="0 picks a free port")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    group.add_argument("--max-num-waiting", type=arg_types.non_negative_int, default=None,
                       help="sequences allowed to wait beyond --max-num-seqs; more get 503 "
                            "with Retry-After (default: no limit)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let requests in flight finish (new ones "
                            "get 503) before aborting them and exiting")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="deprecated, as in vLLM: requests are not logged unless "
                            "--enable-log-requests")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                       help="how to find tool calls in the model's text for tool_choice auto")
    group.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="split <think>...</think> into reasoning_content in chat responses")
    group.add_argument("--headless", action="store_true",
                       help="run only this host's data-parallel replicas (engine cores and "
                            "workers) for the head at --data-parallel-address; no API server")
    group.add_argument("--routing-policy", default="affinity", choices=["affinity", "load"],
                       help="how data-parallel replicas are chosen: affinity (prefix "
                            "affinity, then load) or load (least loaded only)")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--allowed-origins", type=_json_string_list, default=["*"],
                       help='CORS: origins allowed to call the API, a JSON list '
                            '(default: \'["*"]\', any origin)')
    group.add_argument("--allowed-methods", type=_json_string_list, default=["*"],
                       help="CORS: HTTP methods allowed, a JSON list (default: any)")
    group.add_argument("--allowed-headers", type=_json_string_list, default=["*"],
                       help="CORS: request headers allowed, a JSON list (default: any)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send cookies and Authorization headers")
    group.add_argument("--ssl-keyfile", type=_readable_file, default=None,
                       help="serve HTTPS with this private key (PEM)")
    group.add_argument("--ssl-certfile", type=_readable_file, default=None,
                       help="serve HTTPS with this certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", type=_readable_file, default=None,
                       help="CA certificates (PEM) to verify client certificates against")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                       help="client certificates: 0 not asked for, 1 optional, 2 required "
                            "(Python's ssl.CERT_*; needs --ssl-ca-certs)")
    group.add_argument("--root-path", default="",
                       help="the path prefix a reverse proxy serves the API under and strips "
                            "before forwarding, e.g. /llm (links in /docs carry it)")
    group.add_argument("--disable-web-ui", action="store_true",
                       help="do not serve the chat page at / (it then answers 404)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request (its prompt length and sampling parameters)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no stats line every 10 s while requests run (throughput, "
                            "running/waiting requests, KV cache usage)")
    group.add_argument("--enable-control-endpoints", action="store_true",
                       help="serve the control plane for RL loops: /update_weights, "
                            "/pause_generation, /resume_generation, /sleep, /wake_up, "
                            "/is_sleeping, /reset_prefix_cache (docs/weight_updates.md)")
    group.add_argument("--dynamic-load-weight", action="store_true",
                       help="the seed's name: --enable-control-endpoints, with FastDeploy's "
                            "/clear_load_weight and /update_model_weight")
    group.add_argument("--load-strategy", default="ipc_snapshot",
                       choices=["ipc_snapshot", "ipc"],
                       help="what an update without a path reads: ipc_snapshot, the model "
                            "directory's safetensors again (a trainer rewrote them); ipc, the "
                            "manifest a trainer's loom.weight_sync.WeightPublisher wrote in "
                            "the model directory (tensors mapped from its shared memory)")


def _json_string_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings such as '[\"https://example.com\"]', got {text}")
    return value


def _readable_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def ssl_config(args: argparse.Namespace) -> dict:
    """uvicorn.Config's TLS arguments; a ValueError naming the flag when they do not fit
    together or the files are not a certificate and its key."""
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate for that key)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to verify client "
                         "certificates against")
    if (args.ssl_ca_certs or args.ssl_cert_reqs != ssl.CERT_NONE) and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (HTTPS)")
    if args.ssl_certfile:
        try:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
            if args.ssl_ca_certs:
                context.load_verify_locations(args.ssl_ca_certs)
        except ssl.SSLError as error:
            raise ValueError(f"cannot use --ssl-certfile {args.ssl_certfile} with --ssl-keyfile "
                             f"{args.ssl_keyfile} (or --ssl-ca-certs): {error}; pass a PEM "
                             "certificate and its private key") from None
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
            "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}
