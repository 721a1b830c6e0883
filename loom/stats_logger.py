"""LoggingStatLogger: the periodic stats line of ``loom serve``, as vLLM's.

Every ``interval_s`` (10 s; ``LOOM_LOG_STATS_INTERVAL``) while the engine has work, one line::

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 73.2 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 40.0%

and, for a mixture-of-experts model, ", MoE expert load max/mean: 1.84" (the busiest
expert's routed tokens over the mean since start, loom:moe_expert_load_max_over_mean).

It reads the server's Prometheus metrics (loom/metrics.py), so the line and /metrics
never disagree: the throughputs are the token counters' growth over the interval,
the rest the gauges the engine core last reported. An idle server stays quiet, after
one last line that shows the work has drained. ``--disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time

from loom.metrics import ServerMetrics

logger = logging.getLogger("loom.stats")

LOG_INTERVAL_S = 10.0


class LoggingStatLogger:
    def __init__(self, metrics: ServerMetrics, model_name: str,
                 interval_s: float = LOG_INTERVAL_S, prefix: str = "") -> None:
        self.metrics = metrics
        self.prefix = prefix  # e.g. "replica 1: " with data parallel
        self.model_name = model_name
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt_tokens = self._sample("prompt_tokens_total")
        self._last_generation_tokens = self._sample("generation_tokens_total")
        self._last_queries = self._sample("prefix_cache_queries_total")
        self._last_hits = self._sample("prefix_cache_hits_total")
        self._was_active = False

    def log(self, now: float | None = None) -> str | None:
        """Log the line for the interval since the last call; returns it, or None when
        the engine was idle throughout (and was already idle at the last line)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        prompt_tokens = self._sample("prompt_tokens_total")
        generation_tokens = self._sample("generation_tokens_total")
        queries = self._sample("prefix_cache_queries_total")
        hits = self._sample("prefix_cache_hits_total")
        running = int(self._sample("num_requests_running"))
        waiting = int(self._sample("num_requests_waiting"))
        new_prompt = prompt_tokens - self._last_prompt_tokens
        new_generation = generation_tokens - self._last_generation_tokens
        new_queries, new_hits = queries - self._last_queries, hits - self._last_hits
        self._last_time = now
        self._last_prompt_tokens, self._last_generation_tokens = prompt_tokens, generation_tokens
        self._last_queries, self._last_hits = queries, hits
        active = bool(new_prompt or new_generation or running or waiting)
        if not (active or self._was_active):
            return None
        self._was_active = active
        line = (f"{self.prefix}Avg prompt throughput: {new_prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {new_generation / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * self._sample('kv_cache_usage_perc'):.1f}%, "
                f"Prefix cache hit rate: {100 * new_hits / new_queries if new_queries else 0:.1f}%")
        moe_load = self.metrics.registry.get_sample_value(
            "loom:moe_expert_load_max_over_mean", {"model_name": self.model_name})
        if moe_load:
            line += f", MoE expert load max/mean: {moe_load:.2f}"
        logger.info("%s", line)
        return line

    async def run(self) -> None:
        """Log every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log()

    def _sample(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(f"vllm:{name}", self.metrics.labels)
        return value or 0.0
