"""The study loop's guards, on a real SQLite storage: Ctrl-C ends the trial it cut short as FAIL
wherever it landed, heartbeat threads survive a failing beat and say so, and a study refuses
trials measured by another runner, engine or model."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from objectives.scenario import Scenario
from objectives.userfile import InputError
from runners.sim.runner import SimRunner
from search_spaces.space import SearchSpace
from tests.conftest import small_scenario
from tuner.heartbeat import beating
from tuner.storage import open_storage
from tuner.study import StudyRun, create_study
from tuner.trials import optimize


class InterruptedSampler(optuna.samplers.RandomSampler):
    """A sampler during which the user presses Ctrl-C: a real SIGINT to this process, in ask()
    (before_trial) or in the proposal (sample_relative, where GP spends seconds)."""

    def __init__(self, where: str):
        super().__init__(seed=0)
        self.where = where

    def before_trial(self, study, trial):
        if self.where == "ask":
            signal.raise_signal(signal.SIGINT)

    def sample_relative(self, study, trial, search_space):
        if self.where == "proposal":
            signal.raise_signal(signal.SIGINT)
        return super().sample_relative(study, trial, search_space)


class InterruptedRunner(SimRunner):
    """The simulator, interrupted while it checks what a config cannot run."""

    def violations(self, config, workload):
        signal.raise_signal(signal.SIGINT)
        return super().violations(config, workload)


def _run(tmp_path: Path, sampler: optuna.samplers.BaseSampler, runner: SimRunner) -> StudyRun:
    scenario = small_scenario(requests=50)
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = create_study(storage, "s", sampler, scenario, runner.identity())
    return StudyRun(
        study, scenario, SearchSpace.load("mindie").fit_workload(scenario.workload), runner, storage
    )


@pytest.mark.parametrize("where", ["ask", "proposal", "runner"])
def test_ctrl_c_ends_the_trial_it_interrupted_as_fail(where: str, tmp_path: Path):
    sampler = InterruptedSampler(where)
    runner = InterruptedRunner() if where == "runner" else SimRunner()
    run = _run(tmp_path, sampler, runner)
    with pytest.raises(KeyboardInterrupt):
        optimize(run, 3, None)
    # Every trial the interrupt cut short, and no more: a simulated study asks a batch of two
    # before it runs them (tuner.trials), so an interrupt after the asks cuts both.
    trials = run.study.get_trials()
    assert len(trials) == (1 if where == "ask" else 2)
    assert all(t.state == TrialState.FAIL for t in trials)
    assert all(t.user_attrs["fault_kind"] == "interrupted" for t in trials)


def test_a_failing_beat_is_said_once_and_retried(capsys):
    calls, enough = [], threading.Event()

    def beat() -> None:
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("database is locked\nsecond line")
        if len(calls) >= 4:
            enough.set()

    with beating(beat, 0.01, "the heartbeat of trial 7"):
        assert enough.wait(30)  # a bound against a hang: the thread must outlive its failures
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "autotune: warning: the heartbeat of trial 7 failed (database is locked); "
        "retrying every 0.01 s",
        "autotune: the heartbeat of trial 7 beats again",
    ]


SIM = {"runner": "sim", "engine": "mindie", "model": "qwen2-7b", "hardware": "ascend-910b2"}


def test_a_study_refuses_trials_measured_by_another_runner_engine_or_model(tmp_path: Path):
    scenario = small_scenario(requests=50)
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    sampler = optuna.samplers.RandomSampler(seed=0)
    create_study(storage, "s", sampler, scenario, SIM)
    real = {"runner": "llamacpp", "engine": "llamacpp", "model": "qwen2-7b", "hardware": "host-a"}
    with pytest.raises(
        InputError,
        match="measured with runner sim, engine mindie, not runner llamacpp, "
        "engine llamacpp; they cannot be compared",
    ):
        create_study(storage, "s", sampler, scenario, real)
    with pytest.raises(InputError, match="measured with model qwen2-7b, not model other"):
        create_study(storage, "s", sampler, scenario, SIM | {"model": "other"})
    with pytest.raises(InputError, match="measured with hardware ascend-910b2, not hardware h100"):
        create_study(
            storage, "s", sampler, scenario, SIM | {"hardware": "h100"}
        )  # a simulated profile decides
    create_study(storage, "s", sampler, scenario, SIM)  # the same identity resumes

    create_study(storage, "r", sampler, scenario, real)
    create_study(
        storage, "r", sampler, scenario, real | {"hardware": "host-b"}
    )  # a second worker's host label


def test_a_study_recorded_before_a_scenario_field_existed_resumes(tmp_path: Path):
    """A field added since (load.early_rejection) that the user never set is no change; a study
    whose trials carry other constraints (an older autotune's) is refused, not mixed."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    scenario = small_scenario()
    identity = SimRunner().identity()
    study = create_study(storage, "old", optuna.samplers.RandomSampler(), scenario, identity)
    older = scenario.model_dump(mode="json")
    del older["load"]["early_rejection"]
    study.set_user_attr("scenario", older)
    create_study(storage, "old", optuna.samplers.RandomSampler(), scenario, identity)  # resumes

    trial = study.ask()
    trial.set_user_attr(
        "sla_constraints", {"ttft_p99": -0.5}
    )  # before success_rate was a constraint
    study.tell(trial, [100.0, 1000.0])
    with pytest.raises(
        InputError,
        match="carry the constraints ttft_p99, not ttft_p99, tpot_p99, success_rate, sustained",
    ):
        create_study(storage, "old", optuna.samplers.RandomSampler(), scenario, identity)


def test_a_study_refuses_another_chip_budget(tmp_path: Path):
    """`--study X --chips 4` must not join a one-chip study X (its throughputs are one
    instance's, not per chip of a deployment), nor the reverse (issue 30, item 2)."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    sampler = optuna.samplers.RandomSampler(seed=0)
    scenario = small_scenario()
    one_chip = SimRunner().identity()
    assert "chips" not in one_chip
    create_study(storage, "one", sampler, scenario, one_chip)
    with pytest.raises(InputError, match="measured with chips 1, not chips 4"):
        create_study(storage, "one", sampler, scenario, one_chip | {"chips": "4"})
    create_study(storage, "four", sampler, scenario, one_chip | {"chips": "4"})
    with pytest.raises(InputError, match="measured with chips 4, not chips 1"):
        create_study(storage, "four", sampler, scenario, one_chip)
    with pytest.raises(InputError, match="measured with chips 4, not chips 2"):
        create_study(storage, "four", sampler, scenario, one_chip | {"chips": "2"})


def test_a_session_study_recorded_before_turns_were_paced_is_refused(tmp_path: Path):
    """Its trials planned every answer as instant (turns spilled past short loads, so its
    capacities flatter): unlike a field added since, today's default pace is a change, and its
    trials must not share a front with paced ones."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    data = small_scenario().model_dump(mode="json")
    data["workload"]["sessions"] = {"turns": {"kind": "fixed", "value": 3}}
    scenario = Scenario.model_validate(data)
    identity = SimRunner().identity()
    study = create_study(storage, "chat", optuna.samplers.RandomSampler(), scenario, identity)
    create_study(storage, "chat", optuna.samplers.RandomSampler(), scenario, identity)  # resumes
    older = scenario.model_dump(mode="json")
    for field in ("first_token_wait_ms", "read_ms_per_token"):
        del older["workload"]["sessions"][field]
    study.set_user_attr("scenario", older)
    with pytest.raises(InputError, match="session turns are now planned at the users' pace"):
        create_study(storage, "chat", optuna.samplers.RandomSampler(), scenario, identity)
