"""The study loop: ask Optuna for a config, run it, score it, tell Optuna; snapshot the front."""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import (
    DIRECTIONS,
    constraint_values,
    is_feasible,
    objective_names,
    objective_values,
    pick_best,
    quality_constraint_values,
)
from objectives.userfile import InputError, first_line
from runners.base import Runner
from runners.capacity import evaluate
from runners.measurement import Fault
from runners.sim.calibration import METRICS, Observation
from search_spaces.space import SearchSpace
from tuner.console import err
from tuner.interrupts import interrupts_deferred
from tuner.quality import QualityBook, default_book, trial_figures
from tuner.storage import claim_trial, ensure_budget, release_claim, save_snapshot

WORKER = f"{socket.gethostname()}:{os.getpid()}"
# What a trial's numbers depend on: a study keeps them, and refuses a scenario that changed them.
SCENARIO_MEASURES = ("workload", "sla", "load", "pick", "tie_tolerance", "quality")
CONSTRAINTS_ATTR = "constraints"  # optuna.study._constrained_optimization's key
MEASURED_BY = (
    "runner",
    "engine",
    "model",
)  # of a study's identity: what its trials were measured with


def default_study_name(scenario: Scenario, identity: dict[str, str]) -> str:
    return ".".join(
        [
            scenario.name,
            identity["runner"],
            identity["engine"],
            identity["model"],
            identity["hardware"],
        ]
    )


@dataclass
class TrialReport:
    number: int
    config: dict[str, Any]
    status: (
        str  # "feasible", "violates-sla" (the latency SLA or the quality SLO), "infeasible", "fail"
    )
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
    quality: QualityBook | None = (
        None  # each trial's quality figure (default: the runner's model's shipped table)
    )

    def __post_init__(self):
        if self.quality is None:
            self.quality = default_book(self.study, self.runner)


def _check_identity(name: str, recorded: dict[str, str] | None, current: dict[str, str]) -> None:
    """A study's trials are comparable only when measured by the same runner, engine and model
    (simulated and real trials must never mix), and on the simulator the same hardware profile.
    A real engine's hardware is a label, by default each host's name: workers on several hosts
    of one kind share a study, so it is not compared."""
    keys = MEASURED_BY + (("hardware",) if current["runner"] == "sim" else ())
    changed = [
        key for key in keys if recorded is not None and recorded.get(key) != current.get(key)
    ]
    if changed:
        was = ", ".join(f"{key} {recorded.get(key)}" for key in changed)
        now = ", ".join(f"{key} {current.get(key)}" for key in changed)
        raise InputError(
            f"--study {name}: its trials were measured with {was}, not {now}; they cannot be "
            "compared, so give a new --study name"
        )


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


def create_study(
    storage: optuna.storages.BaseStorage,
    name: str,
    sampler: optuna.samplers.BaseSampler,
    scenario: Scenario,
    identity: dict[str, str],
) -> optuna.Study:
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        sampler=sampler,
        directions=list(DIRECTIONS),
        load_if_exists=True,
    )
    recorded, current = _recorded_scenario(study), scenario.model_dump(mode="json")
    changed = [
        key
        for key in SCENARIO_MEASURES
        if recorded is not None and recorded.get(key) != current[key]
    ]
    if changed:
        raise InputError(
            f"--study {name}: its trials were measured under another scenario ({', '.join(changed)} "
            "changed), so they cannot be compared; give a new --study name"
        )
    _check_identity(name, study.user_attrs.get("identity"), identity)
    _check_constraint_names(name, study, scenario)
    study.set_user_attr("scenario", current)
    with warnings.catch_warnings():  # experimental in Optuna; optuna-dashboard shows the names
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(objective_names(scenario)))
    study.set_user_attr("identity", identity)
    ensure_budget(storage, name, len(study.trials))
    return study


@contextmanager
def beating(beat: Callable[[], None], every_s: float, name: str):
    """Call `beat` every `every_s` seconds from a thread (named `name`, which the log says)
    while the block runs. A beat that fails (the database away for a while, a lock lost) is
    said on stderr, one line when it starts failing and one when it beats again, and retried
    at the next beat: a thread that died silently would let the trial or lock go stale."""
    stop = threading.Event()

    def loop() -> None:
        failing = False
        while not stop.wait(every_s):
            try:
                beat()
            except Exception as error:
                if not failing:
                    err.print(
                        f"autotune: warning: {name} failed ({first_line(error)}); retrying every {every_s:g} s",
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
                failing = True
            else:
                if failing:
                    err.print(f"autotune: {name} beats again", markup=False, highlight=False)
                failing = False

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
    return beating(
        lambda: storage.record_heartbeat(trial._trial_id),
        storage.get_heartbeat_interval(),
        f"the heartbeat of trial {trial.number}",
    )


def _tell(
    study: optuna.Study,
    trial: optuna.Trial,
    values: list[float] | None = None,
    state: TrialState | None = None,
) -> None:
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
    trial.storage.set_trial_system_attr(
        trial._trial_id, CONSTRAINTS_ATTR, list(constraints.values())
    )
    trial.set_user_attr("sla_constraints", constraints)


def run_trial(run: StudyRun, trial: optuna.Trial) -> TrialReport:
    scenario, workload = run.scenario, run.scenario.workload
    config = run.space.suggest(trial)
    trial.set_user_attr("knobs", config)
    reasons = run.space.violations(config, workload) + run.runner.violations(config, workload)
    if reasons:
        return _fail(run.study, trial, config, Fault("infeasible", "; ".join(reasons)))
    args = run.runner.engine_args(config, workload)
    if args is not None:  # the export deploys exactly these (tuner/export.py)
        trial.set_user_attr("engine_args", args)
    run.quality.before_session(config)
    evaluation = evaluate(run.runner, config, scenario, on_session=run.quality.session_hook(config))
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
        first = evaluation.extra.get("first_error")
        why = f"; first error: {first}" if first else ""
        return _fail(
            run.study,
            trial,
            config,
            Fault(
                "error",
                f"no request succeeded at the nominal rate: no TTFT or throughput to report{why}",
            ),
        )
    quality = run.quality.trial_attrs(config)
    for key, value in quality.items():
        trial.set_user_attr(key, value)
    constraints = constraint_values(metrics, scenario.sla) | quality_constraint_values(
        trial_figures(quality), scenario.quality
    )
    record_constraints(trial, constraints)
    status = "feasible" if is_feasible(constraints) else "violates-sla"
    trial.set_user_attr("status", status)
    _tell(run.study, trial, list(values))
    return TrialReport(trial.number, config, status, values)


def _end_interrupted(run: StudyRun, trial: optuna.Trial | None) -> None:
    """Wherever Ctrl-C landed (the sampler, the engine, our bookkeeping), the trial it cut
    short ends FAIL "interrupted", not RUNNING until a later run fails it as stale; before a
    trial existed, its claimed slot is given back."""
    if trial is None:
        release_claim(run.storage, run.study.study_name)
    elif trial.storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
        _fail(
            run.study,
            trial,
            trial.user_attrs.get("knobs", {}),
            Fault("interrupted", "interrupted by the user"),
        )


def _running(study: optuna.Study) -> bool:
    return bool(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def optimize(
    run: StudyRun,
    trials: int,
    timeout_s: float | None,
    on_trial: Callable[[TrialReport], None] = lambda report: None,
    study_total: int | None = None,
) -> None:
    """Run up to `trials` trials. With `study_total`, all workers of the study together run
    exactly that many: each claims a slot first, and a worker that finds none left waits for
    the others' running trials, since a dead worker's trial is failed and its slot given back."""
    started = time.monotonic()
    ran = 0
    while ran < trials and (timeout_s is None or time.monotonic() - started < timeout_s):
        optuna.storages.fail_stale_trials(run.study)
        if claim_trial(run.storage, run.study.study_name, study_total):
            trial = None
            try:
                if run.screen is not None:
                    run.screen.propose(run.study)
                with interrupts_deferred():  # ask() stores the trial RUNNING before we hold it
                    trial = run.study.ask()
                trial.set_user_attr("worker", WORKER)
                with heartbeat(run.storage, trial):
                    report = run_trial(run, trial)
            except KeyboardInterrupt:
                with interrupts_deferred():
                    _end_interrupted(run, trial)
                raise
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
        steps = attrs.get("capacity_steps") or [
            {"rate": scenario.nominal_rate, **{k: attrs.get(k) for k in METRICS}}
        ]
        for step in steps:
            measured = {
                k: float(step[k]) for k in METRICS if step.get(k) is not None and step[k] > 0
            }
            if "fault" not in step and measured:
                observations.append(
                    Observation(
                        trial.number, trial_knobs(study, trial), float(step["rate"]), measured
                    )
                )
    return observations


def feasible_front(study: optuna.Study) -> list[FrozenTrial]:
    """Optuna's best_trials are the Pareto front of the feasible trials when constraints exist."""
    front = [t for t in study.best_trials if is_feasible(t.constraints)]
    return sorted(front, key=lambda t: t.values[0])


def best_trial(study: optuna.Study, scenario: Scenario) -> FrozenTrial | None:
    front = feasible_front(study)
    key = pick_best(
        [(t.number, t.values[0], t.values[1]) for t in front], scenario.pick, scenario.tie_tolerance
    )
    return None if key is None else next(t for t in front if t.number == key)


def snapshot(study: optuna.Study, scenario: Scenario, storage: optuna.storages.RDBStorage) -> int:
    front = feasible_front(study)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = best_trial(study, scenario)
    feasible = sum(1 for t in done if is_feasible(t.constraints))
    members = [(t, trial_knobs(study, t)) for t in front]
    return save_snapshot(
        storage,
        study.study_name,
        members,
        len(study.trials),
        feasible,
        best.number if best else None,
    )
