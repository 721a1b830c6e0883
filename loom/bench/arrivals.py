"""When benchmark requests are sent: a gamma renewal process, as in ``vllm bench serve``.

Gaps between requests are drawn from Gamma(shape=burstiness, scale=1 / (rate * burstiness)),
so the mean gap is always 1 / rate:

- burstiness 1: exponential gaps, i.e. Poisson arrivals;
- burstiness < 1: burstier (clumps and lulls); > 1: more regular, uniform in the limit.

A rate of ``inf`` sends every request at once (gaps of 0).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(num_requests: int, request_rate: float, burstiness: float = 1.0,
                 seed: int = 0) -> np.ndarray:
    """Seconds between consecutive requests (``num_requests - 1`` gaps after the first)."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    count = max(num_requests - 1, 0)
    if math.isinf(request_rate):
        return np.zeros(count)
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=scale, size=count)


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send time of each request, in seconds from the start of the run; the first is 0."""
    if num_requests == 0:
        return np.zeros(0)
    gaps = arrival_gaps(num_requests, request_rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])
