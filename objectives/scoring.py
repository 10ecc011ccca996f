"""From a measurement's metrics to Optuna's objective and constraint values, and the pick rule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from objectives.scenario import SLA, QualitySLO, Scenario

# Directions of the two objectives, in this order, everywhere: TTFT p99 at the nominal rate,
# and throughput: at capacity (the most the config sustains within the SLA) or, with a fixed
# load, at the nominal rate.
DIRECTIONS = ("minimize", "maximize")


def objective_names(scenario: Scenario) -> tuple[str, str]:
    throughput = (
        "capacity_output_tokens_per_s"
        if scenario.load.mode == "capacity"
        else "output_tokens_per_s"
    )
    return "ttft_p99_ms", throughput


def throughput_label(scenario: Scenario) -> str:
    return "capacity tok/s" if scenario.load.mode == "capacity" else "out tok/s"


def objective_values(metrics: dict[str, Any], scenario: Scenario) -> tuple[float, float] | None:
    """None when a metric stands on no sample: the trial must then be FAIL, not a number."""
    values = tuple(metrics.get(name) for name in objective_names(scenario))
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


# A load is sustained when the engine delivers all but a tolerance of the rate it is offered
# (runners.load.measurement's `delivered_share`): a queue that keeps growing breaks every
# bound in the end, however good the percentiles of a short load look. The tolerance leaves
# room for the backlog's own swings, which shrink with the window as one over the square root of its
# measured requests: 5% at 1,000 (a steady customer-service window of 4,000 reads 0.96-1.02),
# at most 15% (a 200-request window of a queue at 80% load read below 0.95 one time in five).
SUSTAIN_TOLERANCE = 0.05
SUSTAIN_TOLERANCE_AT = 1000
SUSTAIN_TOLERANCE_MAX = 0.15


def sustain_tolerance(measured: int) -> float:
    """The delivered share a window of `measured` requests after its warm-up may fall short."""
    scaled = SUSTAIN_TOLERANCE * math.sqrt(SUSTAIN_TOLERANCE_AT / max(measured, 1))
    return min(SUSTAIN_TOLERANCE_MAX, scaled)


def constraint_values(metrics: dict[str, Any], sla: SLA) -> dict[str, float]:
    """Relative SLA violations: <= 0 is feasible (Optuna's convention for set_constraint).
    `sustained` is part of every SLA: a load too short to judge it (no `delivered_share`)
    passes it."""
    constraints = {"ttft_p99": metrics["ttft_p99_ms"] / sla.ttft_p99_ms - 1.0}
    if sla.tpot_p99_ms is not None:
        tpot = metrics.get("tpot_p99_ms")
        # No multi-token request means TPOT was never observed: that cannot prove the SLO met.
        constraints["tpot_p99"] = 1.0 if tpot is None else tpot / sla.tpot_p99_ms - 1.0
    constraints["success_rate"] = sla.required_success_rate - metrics["success_rate"]
    if sla.burst_ttft_p99_ms is not None:
        burst = metrics.get("burst_ttft_p99_ms")
        constraints["burst_ttft_p99"] = (
            1.0 if burst is None else burst / sla.burst_ttft_p99_ms - 1.0
        )
        # A queue the burst left that never drained: an avalanche, whatever its TTFTs.
        constraints["burst_recovered"] = 0.0 if metrics.get("burst_recovered") else 1.0
    share = metrics.get("delivered_share")
    measured = metrics.get("requests_sent", 0) - metrics.get("warmup_requests", 0)
    constraints["sustained"] = 0.0 if share is None else 1.0 - sustain_tolerance(measured) - share
    return constraints


QUALITY_PREFIX = "quality_"  # quality constraints' names start with it, beside the SLA's


def quality_constraint_values(
    figures: dict[str, float | None], slo: QualitySLO | None
) -> dict[str, float]:
    """The quality SLO in the same form: how far each bounded figure is past its limit, in the
    figure's own units (points, nats, share), <= 0 feasible. A figure nobody could supply cannot
    prove the SLO met: it counts as violated by 1."""
    constraints = {}
    for figure, limit in (slo.bounds() if slo else {}).items():
        value = figures.get(figure)
        if value is None:
            constraints[QUALITY_PREFIX + figure] = 1.0
        else:
            constraints[QUALITY_PREFIX + figure] = (
                limit - value if figure == "top1_agreement" else value - limit
            )
    return constraints


def meets_sla(named: dict[str, float]) -> bool:
    """The latency SLA alone (the quality constraints left out), from a trial's named
    constraints."""
    return all(value <= 0 for name, value in named.items() if not name.startswith(QUALITY_PREFIX))


def is_feasible(constraints: dict[str, float]) -> bool:
    return all(value <= 0 for value in constraints.values())


def pick_best(
    candidates: Sequence[tuple[Any, float, float]], pick: str, tie_tolerance: float = 0.0
) -> Any | None:
    """candidates: (key, ttft_p99_ms, output_tokens_per_s), all SLA-feasible.

    max-throughput: highest throughput; among those within tie_tolerance of it, lowest TTFT p99.
    min-ttft: lowest TTFT p99; among those within tie_tolerance of it, highest throughput.
    """
    if not candidates:
        return None
    if pick == "min-ttft":
        floor = min(c[1] for c in candidates)
        tied = [c for c in candidates if c[1] <= floor * (1 + tie_tolerance)]
        return min(tied, key=lambda c: (-c[2], c[1]))[0]
    top = max(c[2] for c in candidates)
    tied = [c for c in candidates if c[2] >= top * (1 - tie_tolerance)]
    return min(tied, key=lambda c: (c[1], -c[2]))[0]
