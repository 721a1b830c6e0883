"""Arrival processes: gamma gaps with mean 1/rate; burstiness shapes the variance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loom.bench.arrivals import arrival_gaps, arrival_times


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5


def test_first_request_leaves_at_once_and_times_grow():
    times = arrival_times(100, 10.0, seed=1)
    assert times[0] == 0.0 and len(times) == 100
    assert np.all(np.diff(times) >= 0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_and_cv_follows_burstiness(burstiness):
    gaps = arrival_gaps(200_001, request_rate=4.0, burstiness=burstiness, seed=0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    # Gamma(k, θ): coefficient of variation 1/sqrt(k); Poisson (k=1) has CV 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_seeded():
    assert np.array_equal(arrival_gaps(10, 2.0, seed=3), arrival_gaps(10, 2.0, seed=3))
    assert not np.array_equal(arrival_gaps(10, 2.0, seed=3), arrival_gaps(10, 2.0, seed=4))


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rejects_nonpositive_rate_or_burstiness(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_gaps(3, rate, burstiness)
