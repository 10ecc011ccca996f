"""`--screen sim` with a quality SLO a real runner measures (KL, top-1): the simulated trials
cannot know those figures, so the screen judges only the bounds the table answers, and still
proposes configs. The real trial measures the rest. The screen runs the real simulator here;
the "real" study is an empty Optuna study (its runner is not under test)."""

from __future__ import annotations

import optuna

from objectives.quality import find_shipped
from objectives.scenario import QualitySLO
from runners.sim.runner import SimRunner
from search_spaces.space import SearchSpace
from tests.conftest import small_scenario
from tuner.quality import AppliedTable, QualityBook
from tuner.quality_plan import table_answered
from tuner.screen import Screen
from tuner.study import STUDY_DIRECTIONS


def test_a_screen_with_a_kl_bound_still_proposes_a_config():
    base = small_scenario(requests=100)
    scenario = base.model_copy(update={"quality": QualitySLO(max_kl=0.05, max_accuracy_drop=2.0)})
    runner = SimRunner("vllm", "qwen2-7b", "h100")
    space = runner.adapt(SearchSpace.load("vllm", None).fit_workload(scenario.workload, "s"))
    _, table = find_shipped("qwen2-7b")
    applied = AppliedTable("shipped", *table.for_model("qwen2-7b"))
    real = optuna.create_study(directions=list(STUDY_DIRECTIONS))
    real.set_user_attr("scenario", scenario.model_dump(mode="json"))
    screen = Screen(runner, scenario, space, 6, calibration_iterations=0, seed=0)
    screen.attach(optuna.storages.InMemoryStorage(), "real")
    screen.quality = QualityBook(real, None, applied, log=lambda line: None)
    screen.simulated = table_answered(scenario, applied, space)
    assert screen.simulated.quality == QualitySLO(max_accuracy_drop=2.0)  # KL: the real trials'
    screen.propose(real)
    (waiting,) = real.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert waiting.user_attrs["screen"]["round"] == 1
