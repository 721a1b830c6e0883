"""Plot a run_all summary: throughput and latency vs batch size / concurrency, per engine.

    python benchmarks/plot_results.py benchmarks/results/summary.json   # -> plot.png beside it

Three panels: offline output tok/s vs batch size; serving output tok/s vs concurrency;
serving median TPOT (p99 as error bar top) vs concurrency. Needs matplotlib (any env);
without it, says so and exits 0.
"""

from __future__ import annotations

import json
import os
import sys

COLORS = {"loom": "#d62728", "transformers": "#7f7f7f", "vllm": "#1f77b4", "llamacpp": "#2ca02c"}


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "summary.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is not installed; no plot (pip install matplotlib)")
        return 0
    with open(path) as f:
        summary = json.load(f)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for engine, per_batch in summary.get("offline", {}).items():
        xs = sorted(per_batch, key=int)
        ys = [per_batch[x].get("output_tokens_per_s") for x in xs]
        axes[0].plot([int(x) for x in xs], ys, "o-", label=engine, color=COLORS.get(engine))
    for engine, per_conc in summary.get("serving", {}).items():
        # A concurrency where every request failed has no throughput or latency to plot.
        xs = sorted((x for x in per_conc if per_conc[x].get("completed", 1)), key=int)
        axes[1].plot([int(x) for x in xs], [per_conc[x].get("output_throughput") for x in xs],
                     "o-", label=engine, color=COLORS.get(engine))
        med = [per_conc[x].get("median_tpot_ms") or 0 for x in xs]
        p99 = [per_conc[x].get("p99_tpot_ms") or 0 for x in xs]
        axes[2].errorbar([int(x) for x in xs], med,
                         yerr=[[0] * len(med), [max(p - m, 0) for p, m in zip(p99, med)]],
                         fmt="o-", capsize=3, label=engine, color=COLORS.get(engine))
    titles = ("offline output tok/s (128 in/128 out)", "serving output tok/s",
              "serving TPOT ms (median, bar to p99)")
    xlabels = ("batch size", "concurrent clients", "concurrent clients")
    for ax, title, xlabel in zip(axes, titles, xlabels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ticks = sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    label = summary.get("label") or ""
    fig.suptitle(f"SmolLM2-135M bf16, {summary.get('machine', {}).get('cpus', '?')} CPU cores"
                 + (f" — {label}" if label else ""), fontsize=11)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.abspath(path)), "plot.png")
    fig.savefig(out, dpi=80)
    print(f"plot_results: wrote {out} ({os.path.getsize(out) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
