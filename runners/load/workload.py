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


NO_PREFIX = -1


@dataclass(frozen=True)
class Requests:
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray | None  # None: closed loop with `concurrency` in flight
    concurrency: int | None
    # Which shared prefix each prompt starts with (NO_PREFIX: none), and its length in tokens.
    prefix: np.ndarray | None = None
    prefix_tokens: int = 0

    def __len__(self) -> int:
        return int(self.input_tokens.size)

    def every(self, step: int, arrival_s: np.ndarray | None) -> Requests:
        """Every step-th request (a replica's share), with these arrival times."""
        return Requests(
            self.input_tokens[::step],
            self.output_tokens[::step],
            arrival_s,
            self.concurrency,
            None if self.prefix is None else self.prefix[::step],
            self.prefix_tokens,
        )


def draw_prefixes(workload: Workload, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Which prompts start with which shared prefix, and their lengths made room for it. Its own
    random stream: a scenario's lengths and arrivals are the same with or without a prefix."""
    shared = workload.shared_prefix
    if shared is None:
        return None
    rng = np.random.default_rng([workload.seed, 1])
    n = inputs.size
    sharing = rng.random(n) < shared.share
    prefix = np.where(sharing, rng.integers(0, shared.prompts, size=n), NO_PREFIX)
    return prefix, np.where(sharing, np.maximum(inputs, shared.tokens + 1), inputs)


def with_burst(arrivals: np.ndarray, first: int, end: int, multiple: float) -> np.ndarray:
    """The arrivals with requests first..end-1 coming `multiple` times as fast (their gaps
    divided by it), and every later one as much earlier: the same draw, its burst squeezed."""
    gaps = np.diff(arrivals, prepend=arrivals[0])
    gaps[first + 1 : end] /= multiple
    return np.cumsum(gaps)


def make_requests(workload: Workload) -> Requests:
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    inputs = sample_lengths(workload.input_tokens, n, rng)
    outputs = sample_lengths(workload.output_tokens, n, rng)
    prefix, prefix_tokens = None, 0
    drawn = draw_prefixes(workload, inputs)
    if drawn is not None:
        prefix, inputs = drawn
        prefix_tokens = workload.shared_prefix.tokens  # type: ignore[union-attr]
    arrival = workload.arrival
    if isinstance(arrival, Closed):  # requests follow completions: no arrival times
        return Requests(inputs, outputs, None, arrival.concurrency, prefix, prefix_tokens)
    arrivals = np.cumsum(inter_arrival_s(arrival, n, rng))
    arrivals -= arrivals[0]
    if n > 1 and arrivals[-1] > 0:
        # A draw's own mean rate misses the stated one (seed 0's 200 Poisson arrivals at 2/s span
        # 112.6 s, not 99.5): rescale so the load offers exactly the scenario's rate, keeping
        # the draw's burstiness.
        arrivals *= (n - 1) / (arrival.rate * arrivals[-1])
    if workload.burst is not None:
        arrivals = with_burst(arrivals, *workload.burst.indices(), workload.burst.multiple)
    return Requests(inputs, outputs, arrivals, None, prefix, prefix_tokens)
