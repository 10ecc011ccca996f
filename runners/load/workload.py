"""Requests of a scenario's workload: lengths and arrival times, deterministic for a seed.

Shared by the simulator and the load generator so both replay the very same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from objectives.scenario import Closed, Fixed, Gamma, LogNormal, Normal, Poisson, Uniform, Workload


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
        raise TypeError(f"unknown length distribution {dist!r}")
    return np.clip(np.rint(raw), dist.min, dist.max).astype(np.int64)


def inter_arrival_s(arrival: Poisson | Gamma, n: int, rng: np.random.Generator) -> np.ndarray:
    """Gaps before each request of an open loop (a closed loop's requests follow completions)."""
    if isinstance(arrival, Poisson):
        return rng.exponential(1.0 / arrival.rate, size=n)
    if isinstance(arrival, Gamma):
        # Mean gap stays 1/rate; shape = burstiness (1 is exponential, below 1 is burstier).
        theta = 1.0 / (arrival.rate * arrival.burstiness)
        return rng.gamma(arrival.burstiness, theta, size=n)
    raise TypeError(f"unknown arrival process {arrival!r}")


@dataclass(frozen=True)
class Requests:
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray | None  # None: closed loop with `concurrency` in flight
    concurrency: int | None

    def __len__(self) -> int:
        return int(self.input_tokens.size)


def make_requests(workload: Workload) -> Requests:
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    inputs = sample_lengths(workload.input_tokens, n, rng)
    outputs = sample_lengths(workload.output_tokens, n, rng)
    arrival = workload.arrival
    if isinstance(arrival, Closed):  # requests follow completions: no arrival times
        return Requests(inputs, outputs, None, arrival.concurrency)
    arrivals = np.cumsum(inter_arrival_s(arrival, n, rng))
    arrivals -= arrivals[0]
    if n > 1 and arrivals[-1] > 0:
        # A draw's own mean rate misses the stated one (seed 0's 200 Poisson arrivals at 2/s span
        # 112.6 s, not 99.5): rescale so the load offers exactly the scenario's rate, keeping
        # the draw's burstiness.
        arrivals *= (n - 1) / (arrival.rate * arrivals[-1])
    return Requests(inputs, outputs, arrivals, None)
