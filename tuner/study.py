"""The study loop: ask Optuna for a config, run it, score it, tell Optuna; snapshot the front."""

from __future__ import annotations

import os
import socket
import threading
import warnings
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import (DIRECTIONS, constraint_values, is_feasible, objective_names, objective_values,
                                pick_best)
from runners.base import Runner
from runners.capacity import evaluate
from runners.sim.calibration import METRICS, Observation
from runners.measurement import Fault
from search_spaces.space import SearchSpace
from objectives.userfile import InputError
from tuner.storage import claim_trial, ensure_budget, save_snapshot


WORKER = f"{socket.gethostname()}:{os.getpid()}"
# What a trial's numbers depend on: a study keeps them, and refuses a scenario that changed them.
SCENARIO_MEASURES = ("workload", "sla", "load", "pick", "tie_tolerance")
CONSTRAINTS_ATTR = "constraints"  # optuna.study._constrained_optimization's key


def default_study_name(scenario: Scenario, identity: dict[str, str]) -> str:
    return ".".join([scenario.name, identity["runner"], identity["engine"], identity["model"], identity["hardware"]])


@dataclass
class TrialReport:
    number: int
    config: dict[str, Any]
    status: str  # "feasible", "violates-sla", "infeasible", "fail"
    values: tuple[float, float] | None = None
    reason: str = ""


@dataclass
class StudyRun:
    study: optuna.Study
    scenario: Scenario
    space: SearchSpace
    runner: Runner
    storage: optuna.storages.RDBStorage | None
    reports: list[TrialReport] = field(default_factory=list)
    screen: Any = None  # tuner.screen.Screen: the simulator proposes each trial's config


def create_study(storage: optuna.storages.BaseStorage, name: str, sampler: optuna.samplers.BaseSampler,
                 scenario: Scenario, identity: dict[str, str]) -> optuna.Study:
    study = optuna.create_study(
        storage=storage, study_name=name, sampler=sampler, directions=list(DIRECTIONS), load_if_exists=True
    )
    recorded, current = study.user_attrs.get("scenario"), scenario.model_dump(mode="json")
    changed = [key for key in SCENARIO_MEASURES if recorded is not None and recorded.get(key) != current[key]]
    if changed:
        raise InputError(f"--study {name}: its trials were measured under another scenario ({', '.join(changed)} "
                         "changed), so they cannot be compared; give a new --study name")
    study.set_user_attr("scenario", current)
    with warnings.catch_warnings():  # experimental in Optuna; optuna-dashboard shows the names
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(objective_names(scenario)))
    study.set_user_attr("identity", identity)
    ensure_budget(storage, name, len(study.trials))
    return study


@contextmanager
def beating(beat: Callable[[], None], every_s: float, name: str):
    """Call `beat` every `every_s` seconds from a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            beat()

    thread = threading.Thread(target=loop, daemon=True, name=name)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def heartbeat(storage: optuna.storages.RDBStorage, trial: optuna.Trial):
    """Keep the trial's heartbeat while it runs: if this process dies, the next one to open
    the study sees the heartbeat stop and fails the trial (Optuna's stale-trial check)."""
    storage.record_heartbeat(trial._trial_id)
    return beating(lambda: storage.record_heartbeat(trial._trial_id), storage.get_heartbeat_interval(),
                   "autotune-heartbeat")


def _tell(study: optuna.Study, trial: optuna.Trial, values: list[float] | None = None,
          state: TrialState | None = None) -> None:
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as error:
        # GridSampler ends a finished grid with Study.stop(), which works only inside optimize();
        # Optuna stores the trial before that, and our loop stops on an exhausted grid itself.
        if "Study.stop" not in str(error):
            raise


def _grid_exhausted(study: optuna.Study) -> bool:
    sampler = study.sampler
    return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)


def _fail(study: optuna.Study, trial: optuna.Trial, config: dict, fault: Fault) -> TrialReport:
    status = {"infeasible": "infeasible", "sla-violated": "violates-sla"}.get(fault.kind, "fail")
    trial.set_user_attr("status", status)
    trial.set_user_attr("fault_kind", fault.kind)
    trial.set_user_attr("fault", fault.message)
    if fault.log_tail:
        trial.set_user_attr("log_tail", fault.log_tail[-4000:])
    _tell(study, trial, state=TrialState.FAIL)
    return TrialReport(trial.number, config, status, reason=fault.message)


def record_constraints(trial: optuna.Trial, constraints: dict[str, float]) -> None:
    """The SLA as Optuna's trial constraints, in the list form of the `constraints` system
    attribute: every sampler and `best_trials` read it, and so does optuna-dashboard 0.21, which
    knows nothing of `set_constraint`'s per-key form. The names stay in `sla_constraints`."""
    trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_ATTR, list(constraints.values()))
    trial.set_user_attr("sla_constraints", constraints)


def run_trial(run: StudyRun, trial: optuna.Trial) -> TrialReport:
    scenario, workload = run.scenario, run.scenario.workload
    config = run.space.suggest(trial)
    trial.set_user_attr("knobs", config)
    reasons = run.space.violations(config, workload) + run.runner.violations(config, workload)
    if reasons:
        return _fail(run.study, trial, config, Fault("infeasible", "; ".join(reasons)))
    try:
        evaluation = evaluate(run.runner, config, scenario)
    except KeyboardInterrupt:
        _fail(run.study, trial, config, Fault("interrupted", "interrupted by the user"))
        raise
    for key, value in evaluation.extra.items():
        trial.set_user_attr(f"runner_{key}", value)
    if evaluation.fault is not None:
        for key, value in evaluation.partial.items():  # an early-rejected or failed load
            trial.set_user_attr(f"partial_{key}", value)
        return _fail(run.study, trial, config, evaluation.fault)
    metrics = evaluation.metrics
    for key, value in metrics.items():
        trial.set_user_attr(key, value)
    values = objective_values(metrics, scenario)
    if values is None:
        return _fail(run.study, trial, config, Fault("error", "no request succeeded: no TTFT or throughput to report"))
    constraints = constraint_values(metrics, scenario.sla)
    record_constraints(trial, constraints)
    status = "feasible" if is_feasible(constraints) else "violates-sla"
    trial.set_user_attr("status", status)
    _tell(run.study, trial, list(values))
    return TrialReport(trial.number, config, status, values)


def _running(study: optuna.Study) -> bool:
    return bool(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def optimize(run: StudyRun, trials: int, timeout_s: float | None,
             on_trial: Callable[[TrialReport], None] = lambda report: None, study_total: int | None = None) -> None:
    """Run up to `trials` trials. With `study_total`, all workers of the study together run
    exactly that many: each claims a slot first, and a worker that finds none left waits for
    the others' running trials, since a dead worker's trial is failed and its slot given back."""
    started = time.monotonic()
    ran = 0
    while ran < trials and (timeout_s is None or time.monotonic() - started < timeout_s):
        optuna.storages.fail_stale_trials(run.study)
        if claim_trial(run.storage, run.study.study_name, study_total):
            if run.screen is not None:
                run.screen.propose(run.study)
            trial = run.study.ask()
            trial.set_user_attr("worker", WORKER)
            with heartbeat(run.storage, trial):
                report = run_trial(run, trial)
            run.reports.append(report)
            on_trial(report)
            ran += 1
            if _grid_exhausted(run.study):
                break
        elif _running(run.study):
            time.sleep(min(1.0, run.storage.get_heartbeat_interval()))
        else:
            break


def trial_knobs(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    """Every knob of a trial, as it ran: stored on the trial itself, since each run of a study
    may hold other knobs fixed (studies from before that fall back to the study's record)."""
    if "knobs" in trial.user_attrs:
        return dict(trial.user_attrs["knobs"])
    return study.user_attrs.get("fixed_knobs", {}) | trial.params


def study_observations(study: optuna.Study) -> list[Observation]:
    """Every load a real engine served in the study that ran whole: each step of a capacity
    search (steps stopped early are left out: their figures are partial), or the fixed load."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    observations = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        attrs = trial.user_attrs
        steps = attrs.get("capacity_steps") or [{"rate": scenario.nominal_rate, **{k: attrs.get(k) for k in METRICS}}]
        for step in steps:
            measured = {k: float(step[k]) for k in METRICS if step.get(k) is not None and step[k] > 0}
            if "fault" not in step and measured:
                observations.append(Observation(trial.number, trial_knobs(study, trial), float(step["rate"]), measured))
    return observations


def feasible_front(study: optuna.Study) -> list[FrozenTrial]:
    """Optuna's best_trials are the Pareto front of the feasible trials when constraints exist."""
    front = [t for t in study.best_trials if is_feasible(t.constraints)]
    return sorted(front, key=lambda t: t.values[0])


def best_trial(study: optuna.Study, scenario: Scenario) -> FrozenTrial | None:
    front = feasible_front(study)
    key = pick_best([(t.number, t.values[0], t.values[1]) for t in front], scenario.pick, scenario.tie_tolerance)
    return None if key is None else next(t for t in front if t.number == key)


def snapshot(study: optuna.Study, scenario: Scenario, storage: optuna.storages.RDBStorage) -> int:
    front = feasible_front(study)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = best_trial(study, scenario)
    feasible = sum(1 for t in done if is_feasible(t.constraints))
    members = [(t, trial_knobs(study, t)) for t in front]
    return save_snapshot(storage, study.study_name, members, len(study.trials), feasible, best.number if best else None)
