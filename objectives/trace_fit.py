"""A parametric workload fitted to a trace's window (`autotune scenario fit`): what the trace's
traffic looks like as the distributions a scenario draws from, and how well each fits.

Lengths: a lognormal with the window's median and log spread, truncated to its range, and the
Kolmogorov-Smirnov distance of the window's lengths from it (the largest gap between the two
cumulative distributions: 0 is a perfect fit; above about 0.1 the shape is visibly another).
Arrivals: Poisson at the window's rate where the gaps' coefficient of variation is within 10% of
1, else gamma gaps with that burstiness (1 / CV^2, as vLLM's bench defines it). Prompt blocks
shared between requests: a shared prefix of the median shared length, on the share of prompts
that have one, over as many distinct texts as the trace's shared starts.

What a fit cannot carry is named beside it: a rate that swings over the window (the trace's
busiest and quietest minutes), lengths that move with time, conversations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from objectives.trace import TraceWindow

POISSON_CV = 0.1  # a gaps' CV within this of 1 reads as Poisson
SWING = 1.5  # the busiest minute at this many times the quietest: a rate swing a fit flattens


@dataclass
class Fit:
    workload: dict[str, Any]  # the scenario's workload block
    goodness: dict[str, float]  # per length, its KS distance
    figures: dict[str, float]  # what was measured: rate, CV, minute rates, shared share
    not_carried: list[str] = field(default_factory=list)


def lognormal_fit(values: np.ndarray) -> tuple[dict[str, Any], float]:
    """The truncated lognormal of the module, and the KS distance of `values` from it."""
    low, high = int(values.min()), int(values.max())
    logs = np.log(values.astype(np.float64))
    median, sigma = float(np.exp(np.median(logs))), float(logs.std())
    dist = {"kind": "lognormal", "median": median, "sigma": sigma, "min": low, "max": high}
    if sigma == 0 or low == high:
        return {"kind": "fixed", "value": low}, 0.0
    sorted_values = np.sort(values)
    erf = np.frompyfunc(math.erf, 1, 1)

    def cdf(x: np.ndarray) -> np.ndarray:
        z = (np.log(np.maximum(x, 1e-9)) - np.log(median)) / (sigma * math.sqrt(2))
        return 0.5 * (1 + erf(z).astype(np.float64))

    lo, hi = cdf(np.array([low - 0.5]))[0], cdf(np.array([high + 0.5]))[0]
    # the draw is rounded and clipped to the range: a length k is [k - 0.5, k + 0.5)
    model = np.clip((cdf(sorted_values + 0.5) - lo) / max(hi - lo, 1e-12), 0, 1)
    n = sorted_values.size
    empirical = np.searchsorted(sorted_values, sorted_values, side="right") / n
    return dist, float(np.max(np.abs(empirical - model)))


def minute_rates(arrival_s: np.ndarray) -> np.ndarray:
    """Requests per second in each whole minute of the window."""
    minutes = int(arrival_s[-1] // 60)
    if minutes < 2:
        return np.array([])
    counts = np.bincount((arrival_s // 60).astype(np.int64), minlength=minutes + 1)[:minutes]
    return counts / 60.0


def fit_window(window: TraceWindow, shared: tuple[np.ndarray, np.ndarray] | None = None) -> Fit:
    """The window's fit; `shared`: per request, its shared prompt start's key (-1: none) and
    tokens (runners.load.prefix_chains), where the trace names blocks."""
    inputs, ks_in = lognormal_fit(window.input_tokens)
    outputs, ks_out = lognormal_fit(window.output_tokens)
    gaps = np.diff(window.arrival_s)
    cv = float(gaps.std() / gaps.mean()) if gaps.size > 1 and gaps.mean() > 0 else 1.0
    rate = window.rate
    arrival: dict[str, Any] = {"kind": "poisson", "rate": rate}
    if abs(cv - 1) > POISSON_CV and cv > 0:
        arrival = {"kind": "gamma", "rate": rate, "burstiness": 1 / cv**2}
    workload: dict[str, Any] = {
        "arrival": arrival,
        "num_requests": len(window),
        "input_tokens": inputs,
        "output_tokens": outputs,
    }
    figures = {"rate": rate, "gaps_cv": cv}
    not_carried = []
    per_minute = minute_rates(window.arrival_s)
    if per_minute.size:
        quiet, busy = float(per_minute.min()), float(per_minute.max())
        figures |= {"minute_rate_min": quiet, "minute_rate_max": busy}
        if quiet == 0 or busy / quiet >= SWING:
            not_carried.append(
                f"the rate's swing over the window (minute by minute {quiet:.3g}-{busy:.3g} "
                f"req/s; the fit offers {rate:.3g} throughout)"
            )
    if shared is not None:
        key, tokens = shared
        sharing = key >= 0
        share = float(sharing.mean())
        figures["shared_share"] = share
        if share > 0:
            length = int(np.median(tokens[sharing]))
            prompts = int(np.unique(key[sharing]).size)
            if 0 < length < int(window.input_tokens.max()):
                workload["shared_prefix"] = {
                    "tokens": length,
                    "share": round(share, 4),
                    "prompts": min(prompts, 10_000),
                }
            not_carried.append(
                f"which prompts share which blocks ({prompts} shared starts of varying length, "
                f"their median {length} tokens: the fit draws one length, uniformly over them)"
            )
    if window.session is not None:
        not_carried.append("conversations (the trace's session column; the fit has none)")
    goodness = {"input_tokens": ks_in, "output_tokens": ks_out}
    return Fit(workload, goodness, figures, not_carried)
