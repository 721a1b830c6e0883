"""The markdown tables of benchmarks/spec_decode_bench.sh's results: medians over rounds,
the best run in brackets.

    python benchmarks/spec_decode_summary.py benchmarks/results/spec_decode
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

FIELDS = ("output_tokens_per_s", "output_throughput", "median_decode_step_s",
          "decode_tokens_per_step", "median_tpot_ms", "median_e2el_ms",
          "spec_decode_acceptance_rate", "spec_decode_acceptance_length")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def load(folder: str) -> dict[tuple[str, int, str], dict[str, list[float]]]:
    """(bench, batch or concurrency, speculation) -> field -> one value per round."""
    rows: dict[tuple[str, int, str], dict[str, list[float]]] = {}

    def add(kind: str, size: int, mode: str, record: dict) -> None:
        row = rows.setdefault((kind, size, mode), {})
        if "output_throughput" in record:  # bench serve's name for it
            record = {**record, "output_tokens_per_s": record["output_throughput"]}
        for key in FIELDS:
            if key in record:
                row.setdefault(key, []).append(record[key])

    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        # latency-MODE-ROUND, throughput-MODE-ROUND, serve-MODE-ROUND-cCONCURRENCY
        kind, mode, *rest = os.path.basename(path)[:-len(".json")].split("-")
        with open(path) as f:
            record = json.load(f)
        if kind == "latency":
            for result in record["results"]:
                add(kind, result["batch_size"], mode, result)
        elif kind == "throughput":
            add(kind, record["max_num_seqs"], mode, record)
        else:
            add(kind, int(rest[1][1:]), mode, record)
    return rows


def main(folder: str) -> None:
    rows = load(folder)
    order = sorted(rows, key=lambda key: (("latency", "throughput", "serve").index(key[0]),
                                          key[1], key[2] != "none"))

    def rate_columns(key: tuple[str, int, str]) -> str:
        rates = rows[key]["output_tokens_per_s"]
        base = rows.get((key[0], key[1], "none"), {}).get("output_tokens_per_s", [float("nan")])
        return (f"{len(rates)} | {_median(rates):.1f} ({max(rates):.1f}) | "
                f"{_median(rates) / _median(base):.2f}x ({max(rates) / max(base):.2f}x) | ")

    def spec_columns(row: dict[str, list[float]], mode: str) -> str:
        if mode == "none":
            return "- | - |"
        return (f"{_median(row['spec_decode_acceptance_rate']):.0%} | "
                f"{_median(row['spec_decode_acceptance_length']):.2f} |")

    print("| bench | batch | speculation | runs | output tok/s | speed-up | decode step ms "
          "| tokens/step | acceptance | acceptance length |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for key in order:
        kind, size, mode = key
        if kind == "serve":
            continue
        row = rows[key]
        step = (f"{_median(row['median_decode_step_s']) * 1000:.1f} | "
                f"{_median(row['decode_tokens_per_step']):.2f} | " if kind == "latency"
                else "- | - | ")
        print(f"| {kind} | {size} | {mode} | {rate_columns(key)}{step}{spec_columns(row, mode)}")
    if any(key[0] == "serve" for key in rows):
        print("\n| bench serve | concurrency | speculation | runs | output tok/s | speed-up "
              "| median TPOT ms | median E2EL ms | acceptance | acceptance length |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for key in order:
            kind, size, mode = key
            if kind != "serve":
                continue
            row = rows[key]
            print(f"| chat | {size} | {mode} | {rate_columns(key)}"
                  f"{_median(row['median_tpot_ms']):.1f} | {_median(row['median_e2el_ms']):.0f} | "
                  f"{spec_columns(row, mode)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/spec_decode")
