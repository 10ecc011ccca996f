"""What makes a study's trials comparable: a run adds trials to a study only when they are
measured as the study's own were (same scenario, runner, engine and model, same constraints)."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    check_distribution_compatibility,
)
from optuna.trial import TrialState

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, quality_constraint_values
from objectives.userfile import InputError
from tuner.assumptions import ATTR, changed, describe_changes

# What a trial's numbers depend on: a study keeps them, and refuses a scenario that changed them.
SCENARIO_MEASURES = ("workload", "sla", "load", "pick", "tie_tolerance", "quality")
# Of a study's identity: what its trials were measured with. The chip budget too: a one-chip
# trial's throughput is one instance's, a budget's is per chip of a deployment (absent: one).
MEASURED_BY = ("runner", "engine", "model", "chips")


def check_comparable(
    name: str,
    study: optuna.Study,
    scenario: Scenario,
    identity: dict[str, str],
    assumptions: dict[str, Any] | None = None,
    distributions: dict[str, BaseDistribution] | None = None,
) -> None:
    """Refuse (InputError) a run whose trials could not be compared with the study's own."""
    _check_scenario(name, study, scenario)
    _check_identity(name, study.user_attrs.get("identity"), identity)
    _check_constraint_names(name, study, scenario)
    recorded = study.user_attrs.get(ATTR)
    lines = changed(recorded, assumptions) if recorded and assumptions else []
    if lines:
        raise InputError(
            f"--study {name}: its trials were measured on other figures "
            f"({describe_changes(lines)}), so they cannot be compared; give a new --study name"
        )
    # after the figures: a stricter quality table narrows the choices, and says why first
    _check_choices(name, study, distributions or {})


def _check_scenario(name: str, study: optuna.Study, scenario: Scenario) -> None:
    recorded, current = _recorded_scenario(study), scenario.model_dump(mode="json")
    changed = [
        key
        for key in SCENARIO_MEASURES
        if recorded is not None and recorded.get(key) != current[key]
    ]
    if _turns_planned_unpaced(study.user_attrs.get("scenario")) and "workload" not in changed:
        changed.append("workload (session turns are now planned at the users' pace)")
    if changed:
        raise InputError(
            f"--study {name}: its trials were measured under another scenario "
            f"({', '.join(changed)} changed), so they cannot be compared; give a new --study name"
        )


def _check_identity(name: str, recorded: dict[str, str] | None, current: dict[str, str]) -> None:
    """A study's trials are comparable only when measured by the same runner, engine, model and
    chip budget (simulated and real trials must never mix), and on the simulator the same
    hardware profile.
    A real engine's hardware is a label, by default each host's name: workers on several hosts
    of one kind share a study, so it is not compared."""
    if recorded is None:  # a new study: nothing measured yet
        return
    keys = MEASURED_BY + (("hardware",) if current["runner"] == "sim" else ())

    def value(identity: dict[str, str], key: str) -> str | None:
        return identity.get(key, "1" if key == "chips" else None)  # one chip is unrecorded

    changed = [key for key in keys if value(recorded, key) != value(current, key)]
    if changed:
        was = ", ".join(f"{key} {value(recorded, key)}" for key in changed)
        now = ", ".join(f"{key} {value(current, key)}" for key in changed)
        raise InputError(
            f"--study {name}: its trials were measured with {was}, not {now}; they cannot be "
            "compared, so give a new --study name"
        )


def _check_choices(
    name: str, study: optuna.Study, distributions: dict[str, BaseDistribution]
) -> None:
    """Optuna keeps one set of choices per categorical parameter of a study: a run whose space
    offers others (a narrower --space, a stricter quality SLO) would fail at its first trial.
    Judged by Optuna's own rule (check_distribution_compatibility), which its storage applies
    when the trial sets the parameter."""
    recorded: dict[str, BaseDistribution] = {}
    for trial in study.get_trials(deepcopy=False):
        recorded |= trial.distributions
    for knob, distribution in distributions.items():
        old = recorded.get(knob)
        if old is None:
            continue
        try:
            check_distribution_compatibility(old, distribution)
        except ValueError as error:
            searched = (
                f"this run searches {list(distribution.choices)}, the study's trials "
                f"{list(old.choices)} (a study keeps one set of choices)"
                if isinstance(old, CategoricalDistribution)
                and isinstance(distribution, CategoricalDistribution)
                else str(error)
            )
            raise InputError(
                f"--study {name}: knobs.{knob}: {searched}; give a new --study name, or search "
                "the study's choices"
            ) from None


def _turns_planned_unpaced(recorded: Any) -> bool:
    """A scenario recorded before session turns were paced (objectives.scenario.Sessions): its
    trials planned answers as instant, which today's defaults would not read as a change."""
    workload = recorded.get("workload") if isinstance(recorded, dict) else None
    sessions = workload.get("sessions") if isinstance(workload, dict) else None
    return isinstance(sessions, dict) and "first_token_wait_ms" not in sessions


def _recorded_scenario(study: optuna.Study) -> dict[str, Any] | None:
    """The study's scenario with today's defaults filled in, so that a field added since it was
    recorded (one the user never set) does not read as a change."""
    recorded = study.user_attrs.get("scenario")
    try:
        return (
            None if recorded is None else Scenario.model_validate(recorded).model_dump(mode="json")
        )
    except ValueError:
        return recorded


def constraint_names(scenario: Scenario) -> list[str]:
    """The names of a trial's constraints under this scenario, in their stored order."""
    measured = {"ttft_p99_ms": 0.0, "tpot_p99_ms": 0.0, "success_rate": 1.0}
    return list(
        constraint_values(measured, scenario.sla) | quality_constraint_values({}, scenario.quality)
    )


def _check_constraint_names(name: str, study: optuna.Study, scenario: Scenario) -> None:
    """Samplers compare trials' constraint lists position by position: a study whose trials
    carry other constraints (made by an older autotune) cannot take new ones."""
    expected = constraint_names(scenario)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        named = trial.user_attrs.get("sla_constraints")
        if named is not None and list(named) != expected:
            raise InputError(
                f"--study {name}: its trials carry the constraints {', '.join(named)}, not "
                f"{', '.join(expected)} (made by an older autotune); give a new --study name"
            )
        return
