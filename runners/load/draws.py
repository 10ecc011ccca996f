"""Random draws of a workload: request lengths and an open loop's gaps between arrivals."""

from __future__ import annotations

import numpy as np

from objectives.scenario import Fixed, Gamma, LogNormal, Normal, Observed, Poisson, Uniform


def sample_lengths(dist, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(dist, Fixed):
        return np.full(n, dist.value, dtype=np.int64)
    if isinstance(dist, Uniform):
        return rng.integers(dist.low, dist.high, endpoint=True, size=n)
    if isinstance(dist, Normal):
        raw = rng.normal(dist.mean, dist.std, size=n)
    elif isinstance(dist, LogNormal):
        raw = rng.lognormal(np.log(dist.median), dist.sigma, size=n)
    else:
        raise TypeError(f"no lengths to draw from {dist!r} (a trace's are read, not drawn)")
    return np.clip(np.rint(raw), dist.min, dist.max).astype(np.int64)


# One fixed draw this long gives a distribution's mean length: the same figure for every
# trial, rate, window and arrival draw (within 0.1% of the true mean for the presets').
MEAN_DRAW = 200_000
_means: dict[str, float] = {}


def mean_length(dist) -> float:
    """The mean of a length distribution (as sample_lengths draws and clips it)."""
    if isinstance(dist, Observed):  # a trace's lengths, read: their mean is known
        return dist.mean
    key = dist.model_dump_json()
    if key not in _means:
        _means[key] = float(sample_lengths(dist, MEAN_DRAW, np.random.default_rng(0)).mean())
    return _means[key]


def inter_arrival_s(arrival: Poisson | Gamma, n: int, rng: np.random.Generator) -> np.ndarray:
    """Gaps before each request of an open loop (a closed loop's requests follow completions)."""
    if isinstance(arrival, Poisson):
        return rng.exponential(1.0 / arrival.rate, size=n)
    if isinstance(arrival, Gamma):
        # Mean gap stays 1/rate; shape = burstiness (1 is exponential, below 1 is burstier).
        theta = 1.0 / (arrival.rate * arrival.burstiness)
        return rng.gamma(arrival.burstiness, theta, size=n)
    raise TypeError(f"unknown arrival process {arrival!r}")


def with_burst(arrivals: np.ndarray, first: int, end: int, multiple: float) -> np.ndarray:
    """The arrivals with requests first..end-1 coming `multiple` times as fast (their gaps
    divided by it), and every later one as much earlier: the same draw, its burst squeezed."""
    gaps = np.diff(arrivals, prepend=arrivals[0])
    gaps[first + 1 : end] /= multiple
    return np.cumsum(gaps)


def open_arrivals(
    arrival: Poisson | Gamma,
    n: int,
    rate: float,
    rng: np.random.Generator,
    exact_over: int | None = None,
) -> np.ndarray:
    """n arrival times from 0 whose first `exact_over` (default: all) offer exactly `rate`
    per second."""
    arrivals = np.cumsum(inter_arrival_s(arrival.model_copy(update={"rate": rate}), n, rng))
    arrivals -= arrivals[0]
    last = min(n, n if exact_over is None else exact_over) - 1
    if last > 0 and arrivals[last] > 0:
        # A draw's own mean rate misses the stated one (seed 0's 200 Poisson arrivals at 2/s span
        # 112.6 s, not 99.5): rescale so the load offers exactly the scenario's rate, keeping
        # the draw's burstiness.
        arrivals *= last / (rate * arrivals[last])
    return arrivals
