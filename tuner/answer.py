"""The answer a run gives, computed once: the exported config's capacity as its repeats' worst
draw and its hold left it, the throughput it sustains there, the fleet a stated peak needs and
what it costs. The console's front and summary line, the export and the report render this one
record, so they state the same figures.

A run passes its own hold and repeats in memory (another run on the study may have written
newer ones meanwhile); `autotune export`, `report` and `pareto` read the ones the study keeps
for the trial (tuner.study.hold_of, repeats_of).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from objectives.scenario import Scenario, Workload
from objectives.scoring import objective_names
from runners.load.capacity import fleet_for_peak, sustained_tokens_per_s
from tuner.cost import CHIP_COST_ATTR, cost_figures, describe_cost
from tuner.study import hold_of, repeats_of

# The trial's capacity figures that a lower rate (a repeat's, the hold's) replaces.
CAPACITY_FIGURES = (
    "capacity_rate",
    "capacity_rps",
    "capacity_output_tokens_per_s",
    "capacity_measured_output_tokens_per_s",
    "capacity_ttft_p99_ms",
    "capacity_tpot_p99_ms",
    "capacity_delivered_share",
)


@dataclass(frozen=True)
class Answer:
    trial: FrozenTrial
    scenario: Scenario
    # The trial's attributes with its capacity figures those of the rate every output states.
    metrics: dict[str, Any]
    hold: dict[str, Any] | None  # the export's `hold` block (held_capacity)
    repeats: dict[str, Any] | None  # the export's `repeats` block
    chip_cost_per_hour: float | None
    # the records they come from (tuner.hold.hold_pick, tuner.repeats.repeat_pick), which the
    # console's and the report's lines on them describe
    hold_record: dict[str, Any] | None = None
    repeats_record: dict[str, Any] | None = None

    @property
    def throughput(self) -> float:
        """What the pick rule ranks, at the rate stated: capacity tok/s or, for a fixed load,
        the throughput measured at the nominal rate."""
        value = self.metrics.get(objective_names(self.scenario)[1])
        return float(value) if value is not None else self.trial.values[1]

    @property
    def cost(self) -> dict[str, float]:
        return cost_figures(self.metrics, self.chip_cost_per_hour)

    def describe(self, chips: bool = False) -> str:
        """One line: the capacity, the throughput there, the fleet and its cost."""
        m, scenario = self.metrics, self.scenario
        line = f"trial {self.trial.number}: {self.throughput:.0f} tok/s"
        rate = m.get("capacity_rate")
        if rate is not None:
            unit = "in flight" if scenario.closed_loop else "req/s"
            line += f" at {rate:.4g} {unit} (served {m['capacity_rps']:.4g} req/s)"
            multiple = scenario.workload.multiple_of(rate)
            if multiple is not None:
                line += f", {multiple:.3g}x the trace's rate"
            if "capacity_lowered_from" in m:
                line += (
                    f", lowered from {m['capacity_lowered_from']:.4g} by the "
                    f"{m['capacity_lowered_by']}"
                )
            if m.get("capacity_unheld"):
                line += ", which no hold confirmed"
        peak = scenario.load.peak_rate
        if peak is not None and scenario.load.mode == "capacity":
            fleet = m.get("instances_for_peak")
            counted = "chips" if chips else "instances"
            line += f"; {fleet if fleet else 'no fleet sized'} {counted} for {peak:g} req/s"
        costs = describe_cost(self.cost)
        if costs:
            line += f"; {costs} (a chip at {self.chip_cost_per_hour:g} per hour)"
        return line


def answer(
    study: optuna.Study,
    trial: FrozenTrial,
    hold: dict[str, Any] | None = None,
    repeats: dict[str, Any] | None = None,
) -> Answer:
    """The answer for `trial` from this run's `hold` and `repeats` records (tuner.hold,
    tuner.repeats); None for either: the record the study keeps for the trial."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    number = trial.number
    hold = hold if hold is not None else hold_of(study, number)
    repeats = repeats if repeats is not None else repeats_of(study, number)
    hold_block, repeats_block = held_capacity(hold, number), repeats_summary(repeats, number)
    metrics = answer_metrics(
        dict(trial.user_attrs), hold_block, repeats_block, scenario.load.peak_rate,
        scenario.workload, scenario.closed_loop,
    )  # fmt: skip
    return Answer(
        trial, scenario, metrics, hold_block, repeats_block,
        study.user_attrs.get(CHIP_COST_ATTR),
        hold if hold_block is not None else None,
        repeats if repeats_block is not None else None,
    )  # fmt: skip


def answer_metrics(
    metrics: dict[str, Any],
    hold: dict[str, Any] | None,
    repeats: dict[str, Any] | None,
    peak_rate: float | None,
    workload: Workload,
    closed_loop: bool = False,
) -> dict[str, Any]:
    """The trial's attributes with the capacity every output states: the worst repeat's where
    it is lower, then the rate the hold held, with the worst of its draws' figures (a claim no
    rate held stays, marked unheld, and sizes no fleet); the fleet on what that rate served."""
    if metrics.get("capacity_rate") is None:  # no capacity search, or no rate met
        return metrics
    stated = dict(metrics)
    worst = (repeats or {}).get("worst_capacity")
    if worst is not None and worst["capacity_rate"] is None:  # a repeat no rate met
        return stated | {"capacity_unheld": True, "instances_for_peak": None}
    if worst is not None and worst["capacity_rate"] < stated["capacity_rate"]:
        stated |= worst | {
            "capacity_lowered_from": metrics["capacity_rate"],
            "capacity_lowered_by": "repeats",
            "capacity_at_ceiling": False,
        }
    if hold is not None and hold["held_rate"] is None:
        return stated | {"capacity_unheld": True, "instances_for_peak": None}
    if hold is not None and hold["held_rate"] <= stated["capacity_rate"]:
        # the hold's figures at the rate it held (the worst of its draws), lower or not: the
        # longest loads that rate ran
        load = next(load for load in hold["loads"] if load["rate"] == hold["held_rate"])
        lowered = hold["held_rate"] < stated["capacity_rate"]
        stated |= {
            "capacity_rate": load["rate"],
            # a hold recorded before it kept served_rps kept the whole window's rate
            "capacity_rps": load.get("served_rps", load.get("requests_per_s")),
            "capacity_output_tokens_per_s": sustained_tokens_per_s(
                workload, load["rate"], load["output_tokens_per_s"]
            ),
            "capacity_measured_output_tokens_per_s": load["output_tokens_per_s"],
            "capacity_ttft_p99_ms": load["ttft_p99_ms"],
            "capacity_tpot_p99_ms": load["tpot_p99_ms"],
            "capacity_delivered_share": load["delivered_share"],
        }
        if lowered:
            stated |= {
                "capacity_lowered_from": metrics["capacity_rate"],  # the search's
                "capacity_lowered_by": "hold",
                "capacity_at_ceiling": False,  # the ceiling was the search's, not this rate
            }
    if peak_rate is not None:
        stated["instances_for_peak"] = fleet_for_peak(
            peak_rate, stated["capacity_rate"], stated["capacity_rps"], closed_loop
        )
    return stated


def repeats_summary(repeated: dict[str, Any] | None, trial: int) -> dict[str, Any] | None:
    """The export's `repeats` block for `trial`: its throughput over the repeats, the worst
    (a repeat that missed the SLA reads 0) and, where the repeats searched capacity, the
    worst repeat's capacity figures."""
    if repeated is None or str(trial) not in repeated["trials"]:
        return None
    runs = repeated["trials"][str(trial)]
    values = runs["throughput"]  # None: a repeat that failed
    block = {
        "measurements": len(values),
        "throughput": values,
        "median": statistics.median(v for v in values if v is not None),
        "worst": min(
            v if met and v is not None else 0.0 for v, met in zip(values, runs["met"], strict=True)
        ),
        "ttft_p99_ms": runs["ttft_p99_ms"],
        "noise": repeated["noise"],
        "tied_with": repeated["tied"] if repeated["pick"] == trial else [],
    }
    worst = worst_capacity(repeated, trial)
    if worst is not None:
        block["worst_capacity"] = worst
    return block


def worst_capacity(repeated: dict[str, Any] | None, trial: int) -> dict[str, Any] | None:
    """The capacity figures of `trial`'s worst repeat (a search that met no rate is the worst),
    where the repeats searched capacity."""
    runs = (repeated or {}).get("trials", {}).get(str(trial), {})
    capacities = [c for c in runs.get("capacity", []) if c is not None]
    if not capacities:
        return None
    return min(capacities, key=lambda c: c["capacity_rate"] or -1.0)


def held_capacity(hold: dict[str, Any] | None, trial: int) -> dict[str, Any] | None:
    """The export's `hold` block for `trial` (None when no hold of it is recorded)."""
    if hold is None or hold.get("trial") != trial:
        return None
    block = {key: hold[key] for key in ("factor", "claimed_rate", "held_rate", "loads")}
    for key in ("draws", "extension_cap", "picked", "held"):
        if key in hold:
            block[key] = hold[key]
    return block
