"""Multi-fidelity search (`--screen sim`): the simulator proposes, the real engine decides.

Before each real trial the simulator, with the engine's own scheduler model and a hardware
profile calibrated to the real trials measured so far, runs a round of candidate configs (an
Optuna TPE study of its own, started from the best configs measured for real). The most
promising candidate not yet run for real becomes the next real trial. The real study keeps
only real trials, so its front and export never hold a simulated number; each real trial
records what the simulator predicted for it, and every simulated trial is kept in the study
`<study>.screen` beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import is_feasible, pick_best
from objectives.userfile import InputError
from runners.sim.calibration import fit
from runners.sim.profiles import HardwareProfile, load_hardware, load_model
from runners.sim.runner import SIM_ENGINES, SimRunner
from search_spaces.space import SearchSpace
from tuner.observations import study_observations
from tuner.quality import QualityBook
from tuner.study import STUDY_DIRECTIONS, StudyRun
from tuner.trials import run_trial

SCREENS = ("sim",)
CARRIED = 5  # configs a round starts from: the best measured for real, then the last round's best
RECENT_LOADS = 24  # a recalibration fits the latest loads only, so a round's cost stays bounded


@dataclass
class Screen:
    runner: SimRunner
    scenario: Scenario
    space: SearchSpace
    trials_per_round: int
    calibration_iterations: int
    seed: int
    rounds: int = 0
    calibrated_on: int = 0  # real trials the profile was last fitted to
    carried: list[dict[str, Any]] = field(default_factory=list)
    record: optuna.Study | None = None  # `<study>.screen`: every simulated trial
    # the real study's measured figures, else the table
    quality: QualityBook | None = None
    # The simulated trials' scenario: the quality bounds the table answers. A figure only the
    # real runner measures (KL, top-1) would be unknown in every simulated trial, so violated,
    # and the screen would never propose a precision it has not measured yet.
    simulated: Scenario | None = None

    def attach(self, storage: optuna.storages.BaseStorage, study_name: str) -> None:
        self.record = optuna.create_study(
            storage=storage,
            study_name=f"{study_name}.screen",
            directions=list(STUDY_DIRECTIONS),
            load_if_exists=True,
        )
        self.record.set_user_attr("screens", study_name)

    def propose(self, real: optuna.Study) -> None:
        """Enqueue the next real trial's config in `real` (nothing when no candidate is left, or
        when a config is already waiting: a baseline, or another worker's pick)."""
        if real.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        self._recalibrate(real)
        self.rounds += 1
        sim = optuna.create_study(
            directions=list(STUDY_DIRECTIONS),
            sampler=optuna.samplers.TPESampler(
                seed=(self.seed + self.rounds) % 2**32,  # numpy's seed range
                multivariate=True,
            ),
        )
        for params in _best_params(real, self.scenario, CARRIED) + self.carried:
            sim.enqueue_trial(params, skip_if_exists=True)
        run = StudyRun(
            sim,
            self.simulated or self.scenario,
            self.space,
            self.runner,
            storage=None,
            quality=self.quality,
        )
        for _ in range(self.trials_per_round):
            run_trial(run, sim.ask())
        self._keep(sim)
        ranked = _ranked(sim, self.scenario)
        self.carried = [t.params for t in ranked[:CARRIED]]
        measured = {_key(t.user_attrs.get("knobs", t.params)) for t in real.trials}
        choice = next((t for t in ranked if _key(t.user_attrs["knobs"]) not in measured), None)
        if choice is not None:
            real.enqueue_trial(
                choice.params,
                user_attrs={
                    "screen": {
                        "round": self.rounds,
                        "simulated_trials": len(sim.trials),
                        "hardware": self.runner.hardware.name,
                        "calibrated_on_trials": self.calibrated_on,
                        "predicted_ttft_p99_ms": choice.values[0],
                        "predicted_throughput": choice.values[1],
                    }
                },
            )

    def _recalibrate(self, real: optuna.Study) -> None:
        observations = study_observations(real)
        trials = len({o.trial for o in observations})
        if trials == 0 or trials == self.calibrated_on:
            return
        make_runner = lambda profile: SimRunner(self.runner.engine, self.runner.model, profile)  # noqa: E731
        note = f"calibrated on {trials} real trials of {real.study_name}"
        profile = fit(
            observations[-RECENT_LOADS:],
            self.scenario,
            self.runner.hardware,
            make_runner,
            self.calibration_iterations,
            note,
            self.seed,
        ).profile
        self.runner = make_runner(
            profile.model_copy(
                update={"name": f"{self.runner.hardware.name.split('+')[0]}+calibrated"}
            )
        )
        self.calibrated_on = trials

    def _keep(self, sim: optuna.Study) -> None:
        record = self.record
        assert record is not None, "a screen is given its record (attach) before its first round"
        for t in sim.trials:
            attrs = dict(t.user_attrs) | {
                "round": self.rounds,
                "hardware": self.runner.hardware.name,
            }
            record.add_trial(
                optuna.trial.create_trial(
                    state=t.state,
                    values=t.values,
                    params=t.params,
                    distributions=t.distributions,
                    user_attrs=attrs,
                    system_attrs={k: v for k, v in t.system_attrs.items() if k == "constraints"},
                )
            )


def _key(knobs: dict[str, Any]) -> str:
    return json.dumps(knobs, sort_keys=True, default=str)


def _ranked(study: optuna.Study, scenario: Scenario) -> list[FrozenTrial]:
    """SLA-feasible trials, the pick rule's best first, then by throughput."""
    done = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if is_feasible(t.constraints)
    ]
    best = pick_best(
        [(t.number, t.values[0], t.values[1]) for t in done], scenario.pick, scenario.tie_tolerance
    )
    return sorted(done, key=lambda t: (t.number != best, -t.values[1], t.values[0]))


def _best_params(real: optuna.Study, scenario: Scenario, n: int) -> list[dict[str, Any]]:
    return [t.params for t in _ranked(real, scenario)[:n]]


def plan_screen(
    screen: str | None,
    hardware: str | None,
    trials_per_round: int,
    seed: int,
    runner,
    scenario: Scenario,
    space: SearchSpace,
) -> Screen | None:
    """The screen a run asked for, checked before any storage is touched (attach it after)."""
    if screen is None:
        if hardware is not None:
            raise InputError("--screen-hardware: given without --screen sim")
        return None
    identity = runner.identity()
    if identity["runner"] == "sim":
        raise InputError(
            "--screen: the study's runner is already the simulator; "
            "screen a real runner (--runner vllm, ...)"
        )
    if identity["engine"] not in SIM_ENGINES:
        raise InputError(
            f"--screen: the simulator has no scheduler model for {identity['engine']!r}; "
            f"it models {', '.join(SIM_ENGINES)}"
        )
    if hardware is None:
        raise InputError(
            "--screen-hardware: give the hardware profile to screen with "
            "(`autotune profile-hardware` writes one for this machine; "
            "`autotune calibrate` fits one to real trials)"
        )
    profile: HardwareProfile = load_hardware(hardware, "--screen-hardware")
    shapes = load_model(identity.get("model_path") or identity["model"])
    return Screen(
        SimRunner(identity["engine"], shapes, profile),
        scenario,
        space,
        trials_per_round,
        calibration_iterations=60,
        seed=seed,
    )
