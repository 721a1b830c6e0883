"""Serving metrics with vLLM's definitions (``vllm bench serve``), from per-request timings.

Per request, all times in seconds from the moment the request was sent:

    | ttft |  itl[0]  |  itl[1]  | ... |          E2E latency = ttft + sum(itl)
    send   chunk 0    chunk 1    chunk 2 ...  last chunk

- TTFT: arrival of the first streamed chunk that carries ``choices``.
- ITL: the gaps between consecutive chunks with ``choices`` (one chunk may hold
  several tokens; ITL is per chunk, as in vLLM).
- TPOT = (latency - TTFT) / (output tokens - 1); requests with one output token
  have no TPOT.
- Goodput: requests per second that met every SLO given (``ttft``, ``tpot``,
  ``e2el``, in milliseconds), counted over the whole run's duration.

Percentiles interpolate linearly between samples (``numpy.percentile``'s default).

Speculative decoding, from the engine's counters read before and after the run (drafts:
request-steps that verified drafts): acceptance rate = accepted / draft tokens;
acceptance length = 1 + accepted / drafts, the tokens one such step gives a request.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestResult:
    """What one benchmark request measured; ``success`` False carries ``error``."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (ms in, seconds out)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_NAMES)}; got {item!r}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") \
                from None
        if milliseconds < 0:
            raise ValueError(f"--goodput {item!r}: the limit must be >= 0 ms")
        slos[name] = milliseconds / 1000.0
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    if not result.success:
        return False
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[name] <= limit for name, limit in slos.items())


def summarize(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and the given percentiles of ``values`` (all 0.0 when empty)."""
    if len(values) == 0:
        stats = {"mean": 0.0, "median": 0.0, "std": 0.0}
        stats.update({f"p{_pct_name(p)}": 0.0 for p in percentiles})
        return stats
    array = np.asarray(values, dtype=np.float64)
    stats = {"mean": float(array.mean()), "median": float(np.median(array)),
             "std": float(array.std())}
    stats.update({f"p{_pct_name(p)}": float(np.percentile(array, p)) for p in percentiles})
    return stats


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    slos: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, object]:
    """The run's summary: counts, throughputs and TTFT/TPOT/ITL/E2EL statistics in ms."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    metrics: dict[str, object] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slos:
        metrics["goodput"] = sum(meets_slos(r, slos) for r in done) / duration_s
        metrics["goodput_slos_ms"] = {name: limit * 1000 for name, limit in slos.items()}
    to_ms = 1000.0
    series = {
        "ttft": [r.ttft * to_ms for r in done],
        "tpot": [t * to_ms for r in done if (t := r.tpot) is not None],
        "itl": [gap * to_ms for r in done for gap in r.itl],
        "e2el": [r.latency * to_ms for r in done],
    }
    for name, values in series.items():
        for stat, value in summarize(values, percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    errors = [r.error for r in results if not r.success]
    if errors:
        metrics["errors"] = sorted(set(errors))[:10]
    return metrics


SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_metrics(before: Sequence[float], after: Sequence[float]) -> dict[str, float]:
    """The speculative-decoding figures between two readings of ``SPEC_DECODE_COUNTERS``;
    empty when no draft was verified in between."""
    drafts, draft_tokens, accepted = (b - a for a, b in zip(before, after, strict=True))
    if draft_tokens <= 0:
        return {}
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / draft_tokens,
            "spec_decode_acceptance_length": 1 + accepted / drafts}


def format_spec_decode(metrics: dict[str, object]) -> str:
    """One line, or "" without speculative decoding figures."""
    if "spec_decode_acceptance_rate" not in metrics:
        return ""
    return (f"Speculative decoding: {metrics['spec_decode_acceptance_rate']:.1%} of "
            f"{metrics['spec_decode_num_draft_tokens']:.0f} draft tokens accepted, "
            f"{metrics['spec_decode_acceptance_length']:.2f} tokens per verifying step")


def format_table(metrics: dict[str, object], title: str = "Serving Benchmark Result") -> str:
    """vLLM's result block: counts and throughputs, then mean/median/p99 per latency."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value: object, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", metrics["completed"])
    if metrics["failed"]:
        row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration_s"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if "goodput" in metrics:
        row("Request goodput (req/s):", metrics["goodput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    sections = (("ttft", "Time to First Token"),
                ("tpot", "Time per Output Token (excl. 1st token)"),
                ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))
    for name, label in sections:
        lines.append(f"{' ' + label + ' ':-^60}")
        for stat, stat_label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            key = f"{stat}_{name}_ms"
            if key in metrics:
                row(f"{stat_label} {name.upper()} (ms):", metrics[key])
    if "spec_decode_acceptance_rate" in metrics:
        lines.append(f"{' Speculative Decoding ':-^60}")
        row("Acceptance rate (%):", 100 * metrics["spec_decode_acceptance_rate"])
        row("Acceptance length:", metrics["spec_decode_acceptance_length"])
        row("Drafts:", int(metrics["spec_decode_num_drafts"]))
        row("Draft tokens:", int(metrics["spec_decode_num_draft_tokens"]))
        row("Accepted tokens:", int(metrics["spec_decode_num_accepted_tokens"]))
    lines.append("=" * 60)
    return "\n".join(lines)
