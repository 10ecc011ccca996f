"""When no config met every constraint: the measured config that came closest, with its
capacity, so a user checking the config they run today still learns what it serves."""

from __future__ import annotations

from collections.abc import Sequence

import optuna
from optuna.trial import TrialState

from objectives.scenario import Scenario


def closest_miss(study: optuna.Study, this_run: Sequence[int]) -> str | None:
    """One line on the completed trial with the most output tokens/s within the SLA (the
    capacity search's figure), among this run's trials when it measured any, else the study's:
    what it serves and which constraints it missed at the nominal rate. None when no trial got
    a capacity (each missed the SLA even at the search's floor, or none ran)."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    measured = [
        trial
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if trial.user_attrs.get("capacity_rate") is not None
    ]
    ours = [trial for trial in measured if trial.number in set(this_run)]
    if not (ours or measured):
        return None
    closest = max(
        ours or measured, key=lambda t: t.user_attrs.get("capacity_output_tokens_per_s") or 0.0
    )
    attrs = closest.user_attrs
    missed = [name for name, value in attrs.get("sla_constraints", {}).items() if value > 0]
    unit = "requests in flight" if scenario.closed_loop else "req/s"
    return (
        f"closest: trial {closest.number} serves {attrs['capacity_rate']:.3g} {unit} "
        f"({attrs['capacity_output_tokens_per_s']:.0f} output tok/s) within the SLA, "
        f"against the scenario's nominal {scenario.nominal_rate:g} {unit}; "
        f"at the nominal rate it misses {', '.join(missed) or 'nothing'}"
    )


def why_nothing_met(study: optuna.Study, this_run: Sequence[int], shown: int = 3) -> list[str]:
    """When no trial came close (closest_miss is None): why each of this run's trials gave
    nothing, one line per distinct reason with its trials (the first `shown` reasons)."""
    by_reason: dict[str, list[int]] = {}
    wanted = set(this_run)
    for trial in study.get_trials(deepcopy=False):
        if trial.number not in wanted:
            continue
        attrs = trial.user_attrs
        status = attrs.get("status", trial.state.name.lower())
        reason = attrs.get("fault") or attrs.get("capacity_note")
        if reason is None:
            continue
        label = {"infeasible": "could not run", "violates-sla": "missed the SLA"}.get(
            status, status
        )
        by_reason.setdefault(f"{label}: {reason}", []).append(trial.number)
    lines = [
        f"trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))} {reason}"
        for reason, numbers in list(by_reason.items())[:shown]
    ]
    if len(by_reason) > shown:
        lines.append(f"and {len(by_reason) - shown} other reasons (see `autotune history`)")
    return lines
