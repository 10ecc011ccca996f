"""A study's trials: ask Optuna for configs, run them, score them, tell Optuna.

On the simulator, trials run in batches over worker processes (tuner.parallel): the study asks
for a batch's configs before it tells any of their results, so what it proposes depends on the
order it asks in, never on which process finished first. A batch is every queued trial (the
polish's neighbours, an arm's proposals: fixed before they run, so batching them changes
nothing) or SIM_BATCH sampled ones (TPE's constant liar keeps them apart). A real engine's
trials run one after another, each on the engine it starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from objectives.scoring import (
    constraint_values,
    is_feasible,
    objective_values,
    quality_constraint_values,
)
from runners.load.capacity import Evaluation, evaluate
from runners.load.measurement import Fault
from tuner.attrs import set_user_attrs
from tuner.heartbeat import adopt_unbeaten_trials, heartbeat, heartbeat_interval
from tuner.interrupts import interrupts_deferred
from tuner.parallel import sim_pool
from tuner.quality import trial_figures
from tuner.storage import WORKER, claim_trial, release_claim
from tuner.study import (
    CAPACITY_HINT,
    CONSTRAINTS_ATTR,
    PRUNE_BELOW,
    StudyRun,
    TrialReport,
    balance_deployments,
    has_running_trials,
)

# Sampled trials a simulated study asks for before it tells their results: one per core of
# the 2-core machine it was measured on. A constant, not the core count, so that a seed gives
# the same study on any machine.
SIM_BATCH = 2


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


def _fail(
    study: optuna.Study,
    trial: optuna.Trial,
    config: dict,
    fault: Fault,
    attrs: dict[str, Any] | None = None,
) -> TrialReport:
    """End the trial FAIL with its cause (and `attrs`, what it measured before)."""
    status = {"infeasible": "infeasible", "sla-violated": "violates-sla"}.get(fault.kind, "fail")
    attrs = (attrs or {}) | {"status": status, "fault_kind": fault.kind, "fault": fault.message}
    if fault.log_tail:
        attrs["log_tail"] = fault.log_tail[-4000:]
    set_user_attrs(trial, attrs)
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


@dataclass
class _Job:
    """A trial whose config passed the checks: what its evaluation takes."""

    trial: optuna.Trial
    config: dict[str, Any]
    options: dict[str, Any]  # evaluate's keyword arguments


def _prepare(run: StudyRun, trial: optuna.Trial) -> _Job | TrialReport:
    """The trial's config from the space, checked: a job to evaluate, or the trial ended
    infeasible."""
    workload = run.scenario.workload
    config = run.space.suggest(trial)
    trial.set_user_attr("knobs", config)
    reasons = run.space.violations(config, workload) + run.runner.violations(config, workload)
    if reasons:
        return _fail(run.study, trial, config, Fault("infeasible", "; ".join(reasons)))
    args = run.runner.engine_args(config, workload)
    if args is not None:  # the export deploys exactly these (tuner/export.py)
        trial.set_user_attr("engine_args", args)
    options = {
        "capacity_hint": trial.user_attrs.get(CAPACITY_HINT),
        "prune_below": trial.user_attrs.get(PRUNE_BELOW),
    }
    return _Job(trial, config, options)


def _evaluate_here(run: StudyRun, job: _Job) -> Evaluation:
    book = run.quality
    assert book is not None, "StudyRun.__post_init__ gives every run a quality book"
    book.before_session(job.config)
    on_session = book.session_hook(job.config)
    return evaluate(run.runner, job.config, run.scenario, on_session=on_session, **job.options)


def _record(run: StudyRun, job: _Job, evaluation: Evaluation) -> TrialReport:
    """The trial's end: what it measured, scored against the SLA and the quality SLO."""
    scenario, trial, config, book = run.scenario, job.trial, job.config, run.quality
    assert book is not None, "StudyRun.__post_init__ gives every run a quality book"
    # What the trial measured is written in one transaction (tuner.attrs), just before its end.
    attrs = {f"runner_{key}": value for key, value in evaluation.extra.items()}
    if evaluation.fault is not None:
        # an early-rejected or failed load
        attrs |= {f"partial_{key}": value for key, value in evaluation.partial.items()}
        return _fail(run.study, trial, config, evaluation.fault, attrs)
    metrics = evaluation.metrics
    attrs |= metrics
    if evaluation.pruned is not None:
        set_user_attrs(trial, attrs | {"status": "pruned", "pruned": evaluation.pruned})
        _tell(run.study, trial, state=TrialState.PRUNED)
        return TrialReport(trial.number, config, "pruned", reason=evaluation.pruned)
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
            attrs,
        )
    try:
        quality = book.trial_attrs(config)
        constraints = constraint_values(metrics, scenario.sla) | quality_constraint_values(
            trial_figures(quality), scenario.quality
        )
        record_constraints(trial, constraints)
    except BaseException:  # what the load measured is kept, whatever failed after it
        set_user_attrs(trial, attrs)
        raise
    status = "feasible" if is_feasible(constraints) else "violates-sla"
    set_user_attrs(trial, attrs | quality | {"status": status})
    _tell(run.study, trial, list(values))
    return TrialReport(trial.number, config, status, values)


def run_trial(run: StudyRun, trial: optuna.Trial) -> TrialReport:
    """One asked trial, run here to its end."""
    job = _prepare(run, trial)
    return job if isinstance(job, TrialReport) else _record(run, job, _evaluate_here(run, job))


def _run_batch(
    run: StudyRun, trials: list[optuna.Trial], pool: Executor | None
) -> list[TrialReport]:
    """The trials run (on `pool`'s processes where given) and ended in the order asked."""
    jobs = [_prepare(run, trial) for trial in trials]
    futures = [
        pool.submit(evaluate, run.runner, job.config, run.scenario, **job.options)
        if pool is not None and isinstance(job, _Job)
        else None
        for job in jobs
    ]
    reports = []
    for job, future in zip(jobs, futures, strict=True):
        if isinstance(job, TrialReport):
            reports.append(job)
            continue
        evaluation = _evaluate_here(run, job) if future is None else future.result()
        reports.append(_record(run, job, evaluation))
    return reports


def _end_interrupted(
    run: StudyRun, storage: optuna.storages.RDBStorage, trials: list[optuna.Trial], claimed: int
) -> None:
    """Wherever Ctrl-C landed (the sampler, the engine, our bookkeeping), the trials it cut
    short end FAIL "interrupted", not RUNNING until a later run fails them as stale; a slot
    claimed before its trial existed is given back."""
    for _ in range(claimed - len(trials)):
        release_claim(storage, run.study.study_name)
    for trial in trials:
        if trial.storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
            _fail(
                run.study,
                trial,
                trial.user_attrs.get("knobs", {}),
                Fault("interrupted", "interrupted by the user"),
            )


def batches_in_processes(run: StudyRun) -> bool:
    """Whether the run's trials may run in batches on worker processes: simulated, with no
    engine to measure quality on, proposed by a sampler that keeps a batch's proposals
    apart (a grid hands out its points one by one, and GP's batch would repeat one point)."""
    sampler = run.study.sampler
    samplers = (optuna.samplers.TPESampler, optuna.samplers.RandomSampler)
    return (
        run.runner.name == "sim"
        and run.screen is None
        and run.quality is not None
        and run.quality.measure is None
        and isinstance(sampler, samplers)
    )


def _batch_size(run: StudyRun, left: int) -> int:
    if not batches_in_processes(run):
        return 1
    waiting = len(run.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    return min(left, waiting or SIM_BATCH)


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
    storage = run.storage
    assert storage is not None, "only the screen's rounds run with no storage, and not here"
    started = time.monotonic()
    ran = 0
    width = SIM_BATCH if batches_in_processes(run) else 1
    pool = sim_pool(run.runner, width)
    while ran < trials and (timeout_s is None or time.monotonic() - started < timeout_s):
        adopt_unbeaten_trials(storage, run.study)
        optuna.storages.fail_stale_trials(run.study)
        asked: list[optuna.Trial] = []
        claimed = 0
        try:
            with ExitStack() as beats:
                for _ in range(_batch_size(run, trials - ran)):
                    if not claim_trial(storage, run.study.study_name, study_total):
                        break
                    claimed += 1
                    if run.screen is not None:
                        run.screen.propose(run.study)
                    balance_deployments(run)
                    # ask() stores the trial RUNNING: its heartbeat starts at once (a kill -9
                    # in between leaves a trial with none, which the next run's
                    # adopt_unbeaten_trials beats once, so the stale-trial check sees it)
                    with interrupts_deferred():
                        asked.append(run.study.ask())
                        beats.enter_context(heartbeat(storage, asked[-1]))
                    asked[-1].set_user_attr("worker", WORKER)
                reports = _run_batch(run, asked, pool)
        except KeyboardInterrupt:
            with interrupts_deferred():
                _end_interrupted(run, storage, asked, claimed)
            raise
        for report in reports:
            run.reports.append(report)
            on_trial(report)
        ran += len(reports)
        if not asked:
            if not has_running_trials(run.study):
                break
            time.sleep(min(1.0, heartbeat_interval(storage)))
        elif _grid_exhausted(run.study):
            break


def waiting_ids(study: optuna.Study) -> set[int]:
    """The ids of the study's queued trials."""
    return {t._trial_id for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))}


NOT_RUN = {"status": "fail", "fault_kind": "not-run", "fault": "queued by a run that ended first"}


def discard_queued(run: StudyRun, queued: set[int]) -> None:
    """Fail the steps this run queued and did not run (its time ran out, or it was stopped):
    a later run would pop them before its sampler's proposals, and judge them against a climb
    or a prune bound that no longer runs."""
    storage = run.storage if run.storage is not None else run.study._storage  # in memory
    for trial_id in queued & waiting_ids(run.study):
        # Claimed as a run claims a queued trial (only a WAITING one can be, under the row's
        # lock), so a trial another run popped meanwhile is left to it.
        try:
            if not storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # another run measured it meanwhile
            continue
        for key, value in NOT_RUN.items():
            storage.set_trial_user_attr(trial_id, key, value)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
