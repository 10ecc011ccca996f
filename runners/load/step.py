"""One step of the capacity search: a load at one rate, judged on its last window (the
steady-state rule may have extended it), and the figures each step keeps in the trial."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runners.load.measurement import Measurement

# The per-step figures kept in the trial, so a latency-throughput curve can be drawn.
STEP_METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_samples",
    "ttft_trend",
    "idle_ttft_trend",
    "idle_ttft_rise",
    "offered_rps",
    "delivered_rps",
    "delivered_share",
)


@dataclass
class Step:
    """A step judged on its last window: `measurement` and `metrics` are that window's."""

    rate: float
    measurement: Measurement
    metrics: dict[str, Any]
    meets_sla: bool
    windows: int = 1
    requests_all_windows: int = 0
    unsettled: str | None = None  # why the last window was judged though not settled
    cut_short: bool = False  # max_trial_s left no time to extend it
    slowed: bool = False  # met with its TTFT rising, not extended: the engine slowed down

    def record(self) -> dict[str, Any]:
        row: dict[str, Any] = {"rate": self.rate, "meets_sla": self.meets_sla}
        row |= {key: self.metrics.get(key) for key in STEP_METRICS}
        row |= self.horizon()
        fault = self.measurement.fault
        if fault is not None:
            row["fault"] = f"{fault.kind}: {fault.message}"[:300]
        return row

    def horizon(self) -> dict[str, Any]:
        return {
            "horizon_requests": self.measurement.sent,
            "warmup_requests": self.measurement.warmup,
            "windows": self.windows,
            "requests_all_windows": self.requests_all_windows,
            "settled": self.unsettled is None,
            "unsettled": self.unsettled,
            "engine_slowed": self.slowed,
        }
