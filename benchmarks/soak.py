"""Soak or stress a real ``loom serve``, loopback only, bounded in time.

    python benchmarks/soak.py soak --minutes 30            # default model, 8 clients
    python benchmarks/soak.py stress --rounds 100 --hog 2  # the harness's long run

``soak``: a realistic mix (loom.bench.stress) at fixed concurrency; every minute the
resident memory of every server process and that minute's latency percentiles. Reports
stuck requests (over the request timeout), the empty-state check at the end, RSS growth
after warm-up (first sample to last), and p99 drift (last minute's over the first's).
``stress``: rounds of the mixed load under a CPU hog, each followed by the empty-state
check and a probe. Either writes a markdown section to stdout (and --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from loom.bench.stress import CpuHog, WedgeError, soak, stress_round

READY = re.compile(r"ready on (http://\S+)")


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "loom.cli", "serve", *([model] if model else []),
               "--port", "0", *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        match = READY.search(line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, match.group(1)
    raise RuntimeError(f"loom serve exited with {proc.wait()} before it was ready")


def run_soak(args, url: str, pid: int) -> str:
    samples, report, stuck = asyncio.run(soak(url, pid, args.minutes, args.concurrency,
                                              args.max_tokens, sample_s=args.sample_s,
                                              request_timeout_s=args.request_timeout))
    roles = list(samples[0].rss_mib)
    lines = [f"| minute | requests | p50 s | p99 s | {' | '.join(f'{r} RSS MiB' for r in roles)} |",
             "|" + "---|" * (4 + len(roles))]
    for s in samples:
        lines.append(f"| {s.minute:.1f} | {s.requests} | {s.p50_s:.3f} | {s.p99_s:.3f} | "
                     + " | ".join(f"{s.rss_mib.get(r, float('nan')):.0f}" for r in roles) + " |")
    first, last = samples[min(1, len(samples) - 1)], samples[-1]  # minute 1 on: warmed up
    growth = {r: (last.rss_mib[r] - first.rss_mib[r]) / first.rss_mib[r] * 100 for r in roles}
    lines += ["", f"requests: {report.requests} ({report.completed} completed, {report.aborted} "
              f"aborted by the client on purpose), stuck: {stuck}, unexpected errors: "
              f"{len(report.errors)}; empty state after the run: yes (every gauge 0, probe 200)",
              "RSS growth from minute 1 to the end: " + ", ".join(
                  f"{r} {g:+.1f}%" for r, g in growth.items()),
              f"p99 drift: {first.p99_s:.3f} s -> {last.p99_s:.3f} s "
              f"({(last.p99_s / first.p99_s - 1) * 100:+.0f}%)"]
    if report.errors:
        lines += ["", "errors:", *(f"- {e}" for e in report.errors[:20])]
    return "\n".join(lines)


def run_stress(args, url: str) -> str:
    rng = random.Random(args.seed)
    lines = ["| round | requests | completed | aborted | seconds |", "|---|---|---|---|---|"]
    with CpuHog(args.hog):
        for index in range(args.rounds):
            report = asyncio.run(stress_round(url, rng, size=args.size,
                                              max_tokens=args.max_tokens))
            if report.errors:
                raise WedgeError(f"round {index}: {report.errors}")
            lines.append(f"| {index} | {report.requests} | {report.completed} | "
                         f"{report.aborted} | {report.seconds:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["soak", "stress"])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--server-args", default="", help="extra `loom serve` flags")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--size", type=int, default=32, help="requests per stress round")
    parser.add_argument("--hog", type=int, default=2, help="busy processes beside the server")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="soak: a request slower than this counts as stuck")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also append the section to this file")
    args = parser.parse_args()

    proc, url = start_server(args.model, args.server_args.split())
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        body = run_soak(args, url, proc.pid) if args.mode == "soak" else run_stress(args, url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    section = (f"## {args.mode}, {started}\n\n`{command}`\n\n{body}\n\n"
               f"server exit code after SIGTERM: {code}\n")
    print(section)
    if args.out:
        with open(args.out, "a") as out:
            out.write(section + "\n")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
