"""Measurement: the one currency between runners and everything downstream.

Metric definitions, stated once (as in vLLM's `benchmarks/serve.py`):
- TTFT: from sending a request to its first output token.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token.
- ITL: the gaps between consecutive streamed chunks that carry text (real engines only).
- E2EL: from sending a request to its last output token.
- duration: from the first request sent to the last request finished.
- output throughput: output tokens of successful requests / duration; total adds input tokens.
- goodput (DistServe): successful requests that meet every SLO of the scenario / duration.
- success rate: successful requests / requests sent.
- offered rate: (requests sent - 1) / (last send - first send), what the load really offered.
Percentiles use numpy's linear interpolation over successful requests and always carry the
number of samples they stand on; a p99 from fewer than 100 samples is flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from objectives.scenario import SLA

P99_MIN_SAMPLES = 100


def p99_breaking_count(planned: int) -> int:
    """Fewest samples above a bound that put numpy's (linear) p99 of `planned` samples above it."""
    return planned - math.floor(0.99 * (planned - 1))


def load_certainly_fails(
    planned: int, late_ok: int, late_in_flight: int, failed: int, min_success_rate: float
) -> bool:
    """Whether a load of `planned` requests misses its SLA whatever its unfinished requests do.

    The TTFT p99 covers successful requests only, and the success rate counts failures, so a
    late request still in flight may end either way: late (a p99 sample above the bound) or
    failed (one sample fewer, one failure more). The load certainly fails only if every split
    of those breaks one of the two; requests not yet answered in time may all still succeed.
    """
    allowed_failures = math.floor((1.0 - min_success_rate) * planned + 1e-9)
    for failing in range(late_in_flight + 1):
        failures = failed + failing
        if failures > allowed_failures:
            continue  # this future breaks the success rate
        successes_at_most = planned - failures
        if successes_at_most <= 0 or late_ok + late_in_flight - failing < p99_breaking_count(
            successes_at_most
        ):
            return False  # a future where both SLOs may still hold
    return True


@dataclass(frozen=True)
class Fault:
    """Why a trial produced no trustworthy measurement."""

    kind: str  # "infeasible", "start", "crash", "timeout", "error", "sla-violated"
    message: str
    log_tail: str = ""


@dataclass
class Measurement:
    """Per-request records (seconds from load start; NaN where a request never got there)."""

    send_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    ok: np.ndarray
    peak_kv_usage: float | None = None
    itl_s: np.ndarray | None = None  # every inter-chunk gap of successful requests
    fault: Fault | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, fault: Fault, extra: dict[str, Any] | None = None) -> Measurement:
        empty = np.empty(0)
        return cls(
            empty,
            empty,
            empty,
            empty.astype(int),
            empty.astype(int),
            empty.astype(bool),
            fault=fault,
            extra=extra or {},
        )

    @property
    def sent(self) -> int:
        return int(self.send_s.size)


def _percentiles(name: str, samples: np.ndarray, qs: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {f"{name}_samples": int(samples.size)}
    for q in qs:
        out[f"{name}_p{q}_ms"] = float(np.percentile(samples, q) * 1000) if samples.size else None
    return out


def summarize(m: Measurement, sla: SLA) -> dict[str, Any]:
    """Every metric of a measurement, flat, ready to store as trial user attributes."""
    ok = m.ok.astype(bool)
    ttft = (m.first_token_s - m.send_s)[ok]
    e2el = (m.finish_s - m.send_s)[ok]
    out_tokens = m.output_tokens[ok]
    multi = out_tokens > 1
    tpot = (e2el[multi] - ttft[multi]) / (out_tokens[multi] - 1)
    finished = m.finish_s[ok]
    duration = float(finished.max() - m.send_s.min()) if finished.size else 0.0
    per_s = (lambda x: float(x) / duration) if duration > 0 else (lambda x: 0.0)
    send_span = float(m.send_s.max() - m.send_s.min()) if m.sent > 1 else 0.0

    meets = ttft * 1000 <= sla.ttft_p99_ms
    if sla.tpot_p99_ms is not None:
        tpot_all = np.where(out_tokens > 1, (e2el - ttft) / np.maximum(out_tokens - 1, 1), 0.0)
        meets &= tpot_all * 1000 <= sla.tpot_p99_ms

    metrics: dict[str, Any] = {
        "requests_sent": m.sent,
        "requests_ok": int(ok.sum()),
        "success_rate": float(ok.sum() / m.sent) if m.sent else 0.0,
        "duration_s": duration,
        "output_tokens_per_s": per_s(out_tokens.sum()),
        "total_tokens_per_s": per_s(out_tokens.sum() + m.input_tokens[ok].sum()),
        "requests_per_s": per_s(ok.sum()),
        "goodput_rps": per_s(meets.sum()),
        "offered_rps": float((m.sent - 1) / send_span) if send_span > 0 else None,
        "peak_kv_usage": m.peak_kv_usage,
    }
    metrics |= _percentiles("ttft", ttft, (50, 90, 99))
    metrics |= _percentiles("tpot", tpot, (50, 99))
    metrics |= _percentiles("e2el", e2el, (50, 99))
    if m.itl_s is not None:
        metrics |= _percentiles("itl", m.itl_s, (50, 99))
    metrics["p99_low_samples"] = int(ttft.size) < P99_MIN_SAMPLES
    return metrics
