"""A study's real measurements, as the simulator's calibration takes them (`autotune calibrate`,
and `--screen sim` recalibrating as real trials arrive)."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from objectives.scenario import Scenario
from runners.sim.calibration import METRICS, Observation
from tuner.study import trial_knobs


def study_observations(study: optuna.Study) -> list[Observation]:
    """Every load a real engine served in the study that ran whole: each step of a capacity
    search (steps stopped early are left out: their figures are partial), or the fixed load."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    observations = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        attrs = trial.user_attrs
        steps = attrs.get("capacity_steps") or [
            {
                "rate": scenario.nominal_rate,
                # the window it judged, which an unsettled load extended past num_requests
                "horizon_requests": attrs.get("horizon_requests"),
                **{k: attrs.get(k) for k in METRICS},
            }
        ]
        for step in steps:
            measured = {
                k: float(step[k]) for k in METRICS if step.get(k) is not None and step[k] > 0
            }
            if "fault" not in step and measured:
                observations.append(
                    Observation(
                        trial.number,
                        trial_knobs(study, trial),
                        float(step["rate"]),
                        measured,
                        step.get("horizon_requests"),
                    )
                )
    return observations
