"""The steady-state rule: when a load's window is long enough for its verdict to stand.

Every step of runners.load.capacity gets the same verdict whatever the scenario's
`num_requests`. A step's load is a window of `num_requests` requests (below the nominal rate, in
proportion to the rate, at least capacity's MIN_WINDOW) whose first tenth is warm-up, left out
of the percentiles (runners.load.measurement). The window is settled when its verdict cannot be
an accident of where the load stopped: no percentile SLO (TTFT p99, TPOT p99) within
`settle_margin` of its bound (30% at 1,000 requests after the warm-up, narrowing as one over the
fourth root of their number: a short window's p99 misses or catches the bursts that set the
long-run one; nine in ten of customer-service's 1,000-request windows near capacity read
0.65-1.3 times it; and near capacity the p99 keeps rising with the horizon, faster than
independent samples' noise, one over the square root, shrinks: one customer-service export read
409-480 ms on 4,000 requests at its capacity, 478-586 on 16,000, against a 500 ms bound), and,
when it meets the SLA, a TTFT no longer rising (the TTFT trend at most RISING_TREND: a queue
still growing breaks any bound in the end), unless the engine itself is slowing down (the TTFT
of requests that found it idle rising as well, `slowing`: a longer load would only slow it
further; the window is judged as measured and the trial's `capacity_note` says so). An unsettled
window is run again with twice the requests, up to capacity's EXTENSION_CAP times `num_requests`
(a real engine only while `max_trial_s` leaves twice the last window's time), and the step is
judged on its last window, the longest and closest to steady state. A window still unsettled at
the cap is a miss: meeting the SLA has to be shown (a fleet sized on a lucky window comes up
short), except at the nominal rate, whose verdict is the trial's SLA constraint as its window
measured it; one cut short by `max_trial_s` keeps its verdict and says so. Early rejection stays
sound: before the last window a load stops only once its TTFT p99 is certainly beyond the margin
(a miss no longer window would revisit), in the last one once it is certainly past the margin's
lower edge.
"""

from __future__ import annotations

from typing import Any

from objectives.scenario import SLA
from objectives.scoring import constraint_values

# 1,000-request windows below the long-run p99 by 30% or more: about 5% near capacity.
SETTLE_MARGIN = 0.3  # relative to the bound, at SETTLE_MARGIN_AT requests after the warm-up
SETTLE_MARGIN_AT = 1000
SETTLE_MARGIN_MAX = 0.5  # a tiny load's p99 is a guess either way: extend it, within reason
RISING_TREND = 0.7  # 3-7% of steady customer-service windows exceed it, 93% of growing ones
# An idle engine's TTFT still varies with the prompt's length: a slowdown is a rise beyond
# that (llama-server's growing prompt cache made it 7x, issue 30).
SLOWING_RISE = 1.25


# SLOs that are not percentiles a longer window could move (a burst load runs once, as
# written): a window is judged on them whole, never on a part of it.
JUDGED_WHOLE = ("success_rate", "sustained", "burst_ttft_p99", "burst_recovered")


def percentiles_met(metrics: dict[str, Any], sla: SLA) -> bool:
    """Whether every percentile SLO (TTFT p99, TPOT p99) meets its bound."""
    constraints = constraint_values(metrics, sla)
    return all(value <= 0 for name, value in constraints.items() if name not in JUDGED_WHOLE)


def settle_margin(measured: int) -> float:
    """How near its bound a percentile SLO's figure leaves a window unsettled, relative to the
    bound, for a window of `measured` requests after its warm-up."""
    scaled = SETTLE_MARGIN * (SETTLE_MARGIN_AT / max(measured, 1)) ** 0.25
    return min(SETTLE_MARGIN_MAX, scaled)


def slowing(metrics: dict[str, Any]) -> bool:
    """The engine itself slowed down through the window: the TTFT of requests that found it
    idle rose (runners.load.measurement's idle TTFT trend). A longer load would not settle
    that, only slow the engine further; its window is judged as measured and says so."""
    trend, rise = metrics.get("idle_ttft_trend"), metrics.get("idle_ttft_rise")
    return trend is not None and trend > RISING_TREND and rise is not None and rise > SLOWING_RISE


def unsettled(metrics: dict[str, Any], sla: SLA, meets_sla: bool, margin: float) -> str | None:
    """Why a whole window's verdict could be the accident of its horizon; None when settled."""
    constraints = constraint_values(metrics, sla)
    percentiles = {name for name in constraints if name not in JUDGED_WHOLE}
    if meets_sla:
        close = [name for name in percentiles if constraints[name] >= -margin]
        trend = metrics.get("ttft_trend")
        if not close and trend is not None and trend > RISING_TREND and not slowing(metrics):
            return f"TTFT still rising (trend {trend:.2f})"
    else:
        # A miss can flip only if every SLO it misses is a percentile within the margin, or the
        # delivered rate (an engine still filling up to its steady backlog lags its offered one).
        missed = [name for name, value in constraints.items() if value > 0]
        lagging = "sustained" in missed
        close = [name for name in missed if name != "sustained"]
        if any(name not in percentiles or constraints[name] > margin for name in close):
            return None
        if lagging:
            reasons = [f"delivered {metrics['delivered_share']:.0%} of the offered rate"]
            if close:
                reasons.append(f"{', '.join(sorted(close))} within {margin:.0%} of the bound")
            return "; ".join(reasons)
    return f"{', '.join(sorted(close))} within {margin:.0%} of the bound" if close else None
