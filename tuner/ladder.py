"""The quality ladder: for each (precision, KV) pair, the best throughput found that meets the
latency SLA and what the pair costs in quality, so an operator sees what each step down in
accuracy buys. Shown by the console after a run and by the HTML report."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState
from rich.table import Table

from objectives.scenario import Scenario
from objectives.scoring import is_feasible, meets_sla, quality_constraint_values, throughput_label
from runners.quality import quality_pair
from tuner.arms import trials_to_compare
from tuner.console import out
from tuner.quality import EXCLUDED, QualityBook, describe_figures, trial_figures
from tuner.study import trial_knobs


@dataclass
class Rung:
    pair: tuple[str, float]
    quality: dict[str, Any]  # the pair's quality_* attributes
    best_trial: int | None = None  # its highest throughput that met the latency SLA
    throughput: float | None = None
    trials: int = 0  # measured trials with the pair (0: the space dropped it before the study)

    def meets_quality(self, scenario: Scenario) -> bool | None:
        if scenario.quality is None:
            return None
        return is_feasible(quality_constraint_values(trial_figures(self.quality), scenario.quality))


def _order(rung: Rung) -> tuple:
    """Least accuracy lost first: the ladder's steps down."""
    figures = trial_figures(rung.quality)
    unknown = math.inf
    return (
        figures["accuracy_drop"] if figures["accuracy_drop"] is not None else unknown,
        figures["kl"] if figures["kl"] is not None else unknown,
        -(figures["top1_agreement"] or 0.0),
        rung.pair[0],
        -rung.pair[1],
    )


def ladder(study: optuna.Study) -> list[Rung]:
    rungs: dict[tuple[str, float], Rung] = {}
    # A pruned trial searched the pair too (tuner.pruning): it counts, with no figure.
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        pair = quality_pair(trial_knobs(study, t))
        rung = rungs.setdefault(pair, Rung(pair, {}))
        rung.trials += 1
        if t.state == TrialState.PRUNED:
            continue
        rung.quality = {
            k: v for k, v in t.user_attrs.items() if k.startswith("quality_")
        } or rung.quality
        if meets_sla(t.user_attrs.get("sla_constraints", t.constraints)) and (
            rung.throughput is None or t.values[1] > rung.throughput
        ):
            rung.best_trial, rung.throughput = t.number, t.values[1]
    for dropped in study.user_attrs.get(EXCLUDED, []):
        pair = quality_pair(dropped)
        rungs.setdefault(
            pair, Rung(pair, {k: v for k, v in dropped.items() if k.startswith("quality_")})
        )
    return sorted(rungs.values(), key=_order)


LADDER_HEAD = (
    "precision",
    "KV kept",
    "best {throughput} within the SLA",
    "trial",
    "quality",
    "meets quality SLO",
)


def ladder_rows(study: optuna.Study) -> tuple[list[str], list[list[str]]]:
    """The ladder as table cells (head, rows), for the console and the report alike."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    head = [h.format(throughput=throughput_label(scenario)) for h in LADDER_HEAD]
    rows = []
    needed = trials_to_compare(study, ("quantization", "kv_compression"))
    for rung in ladder(study):
        if rung.trials == 0:
            found = "not searched (fails the quality SLO)"
        elif rung.trials < needed:
            found = f"not compared ({rung.trials} trial{'s' if rung.trials > 1 else ''})"
        elif rung.throughput is None:
            found = f"none of {rung.trials} trials met the SLA"
        else:
            found = f"{rung.throughput:.0f}"
        meets = rung.meets_quality(scenario)
        rows.append(
            [
                rung.pair[0],
                f"{rung.pair[1]:g}",
                found,
                "-" if rung.best_trial is None else str(rung.best_trial),
                describe_figures(rung.quality),
                "-" if meets is None else ("yes" if meets else "no"),
            ]
        )
    return head, rows


def ladder_table(study: optuna.Study) -> Table:
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    slo = scenario.quality.describe() if scenario.quality else ""
    title = "Quality ladder: what each step down in accuracy buys" + (
        f" (quality SLO: {slo})" if slo else ""
    )
    head, rows = ladder_rows(study)
    table = Table(title=title)
    for column in head:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def print_quality(study: optuna.Study, book: QualityBook | None) -> None:
    """After a run: the ladder, and what measuring quality cost this run."""
    if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        out.print(ladder_table(study))
    if book is not None and book.measurements:
        out.print(
            f"quality: {book.measurements} precision and KV pairs measured this run, "
            f"{book.measure_s:.1f} s in all"
        )
