"""``loom router``'s flags; no heavy imports here (the parser is built for every
``loom`` command); the router itself is ``loom/router/server.py``."""

from __future__ import annotations

import argparse

from loom.router.policy import PolicyConfig


def add_router_command(commands) -> None:
    parser = commands.add_parser(
        "router", help="one OpenAI-compatible front for several loom serve instances, "
                       "balancing by load and prefix affinity")
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a loom serve instance, http://HOST:PORT; repeat for each")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="prefill/decode disaggregation (docs/disaggregation.md): a loom "
                             "serve --splitwise-role prefill instance; repeat for each, and "
                             "give --decode too")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a loom serve --splitwise-role decode instance; repeat for each")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--health-check-interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between health checks of each backend's /health")
    parser.add_argument("--health-check-timeout", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--prefix-chunk-chars", type=int, default=64,
                        help="prefix affinity hashes prompts in chunks of this many characters")
    parser.add_argument("--routing-policy", default="affinity", choices=["affinity", "load"],
                        help="affinity: prefix affinity, then load (default); load: the least "
                             "loaded backend only")
    parser.add_argument("--min-match-ratio", type=float, default=PolicyConfig.min_match_ratio,
                        help="share of a prompt's chunks a backend must hold for affinity "
                             "to choose it over the least loaded one")
    parser.add_argument("--balance-abs-threshold", type=int,
                        default=PolicyConfig.balance_abs_threshold,
                        help="affinity yields to load when the busiest backend has more than "
                             "this many requests over the idlest ...")
    parser.add_argument("--balance-rel-threshold", type=float,
                        default=PolicyConfig.balance_rel_threshold,
                        help="... and more than this many times its load")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.set_defaults(handler=_run, check=_check)



def _check(args: argparse.Namespace):
    from loom.router.server import router_policy

    return router_policy(args)


def _run(args: argparse.Namespace) -> int:
    from loom.router.server import run_router

    return run_router(args)
