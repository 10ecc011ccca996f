"""Proposals within an arm (tuner.study.propose_within): the side study a sampler proposes
from holds the arm's finished trials only, and the arm's knobs stay as the arm fixes them.
A recording sampler stands in for the study's own (pure logic: no engine)."""

from __future__ import annotations

import optuna

from runners.sim.runner import SimRunner
from search_spaces.space import SearchSpace
from tests.conftest import small_scenario
from tuner.study import StudyRun, propose_within

SHOWN: list[list[str]] = []  # per proposal, the deployments of the trials it was shown


class Recording(optuna.samplers.RandomSampler):
    """A random sampler that notes which trials each proposal was shown."""

    def sample_independent(self, study, trial, param_name, param_distribution):
        if param_name == "batch_size":
            done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            SHOWN.append([t.params["deployment"] for t in done])
        return super().sample_independent(study, trial, param_name, param_distribution)


def test_an_arm_is_proposed_from_its_own_trials():
    runner = SimRunner(engine="mindie", hardware="ascend-910b2", chips=4)
    scenario = small_scenario()
    space = runner.adapt(SearchSpace.load("mindie", None))
    study = optuna.create_study(directions=["minimize", "maximize"])
    for deployment, throughput in (("co-located", 10.0), ("disaggregated", 20.0)) * 3:
        study.enqueue_trial({"deployment": deployment})
        trial = study.ask()
        space.suggest(trial)
        study.tell(trial, [1.0, throughput])
    run = StudyRun(study, scenario, space, runner, None, new_sampler=lambda seed: Recording(seed))
    SHOWN.clear()
    proposals = propose_within(run, {"deployment": "co-located"}, 3)
    assert [p["deployment"] for p in proposals] == ["co-located"] * 3
    colocated = [t for t in study.trials if t.params.get("deployment") == "co-located"]
    assert SHOWN and all(shown == ["co-located"] * len(colocated) for shown in SHOWN)
