"""Fit the simulator's free constants to real measurements, and say how far off it is.

An observation is one load a real engine served: a config, a rate, and what was measured
there (each step of a capacity search is one). The simulator replays the same requests (same
seed, lengths and arrivals) under the engine's own scheduler model, and the fit moves the
hardware figures that engines, not devices, decide (achieved compute and bandwidth shares,
per-step and per-sequence overheads, the latency a client sees outside the engine's steps) to
minimise the mean absolute log error of the FITTED metrics over every observation (each
capped at 3x). The fit is an Optuna study (TPE) that starts from the given profile, so
the result is never worse than the start on the observations it was fitted to; the simulator
is a discrete-event model, too rough at the edges for gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import optuna

from objectives.scenario import Scenario
from runners.measurement import summarize
from runners.sim.profiles import Figure, HardwareProfile

# What the simulator is judged on: both ends of the latency, and the rate.
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
# What it is fitted to: the p99 of a few dozen requests is one request's luck on a busy machine
# (measured: the same load's TTFT p99 varies 2x between runs here), so it is judged, not fitted.
FITTED = ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s")
# The fitted figures and their search ranges (log-uniform).
FREE = {
    "mfu": (0.005, 2.0),
    "mbu": (0.005, 2.0),
    "decode_step_overhead_ms": (0.01, 500.0),
    "prefill_step_overhead_ms": (0.01, 2000.0),
    "per_sequence_overhead_ms": (0.001, 50.0),
    "request_latency_ms": (0.01, 1000.0),
}
MISS_PENALTY = math.log(10)  # a metric the simulator cannot produce (a failed or empty load) counts as 10x off
# An overloaded load's queue makes its TTFT swing by orders of magnitude with a small change of
# the figures; capping each error keeps such loads from steering the whole fit.
ERROR_CAP = math.log(3)


@dataclass(frozen=True)
class Observation:
    trial: int
    config: dict[str, Any]
    rate: float
    measured: dict[str, float]  # METRICS that were measured


def simulate(runner, scenario: Scenario, observation: Observation) -> dict[str, float | None]:
    """The simulator's METRICS for one observation (None where its load failed)."""
    workload = scenario.at_rate(observation.rate)
    with runner.session(observation.config, workload) as session:
        m = session.measure(workload, scenario.sla, False)
    if m.fault is not None or not m.sent:
        return {key: None for key in METRICS}
    metrics = summarize(m, scenario.sla)
    return {key: metrics.get(key) for key in METRICS}


def log_errors(simulated: dict[str, float | None], measured: dict[str, float]) -> list[float]:
    out = []
    for key, real in measured.items():
        if key not in FITTED:
            continue
        sim = simulated.get(key)
        out.append(MISS_PENALTY if sim is None or sim <= 0 else min(ERROR_CAP, abs(math.log(sim / real))))
    return out


def with_figures(base: HardwareProfile, values: dict[str, float], note: str) -> HardwareProfile:
    return base.model_copy(update={key: Figure(value=value, source="measured", note=note) for key, value in values.items()})


def fit(observations: list[Observation], scenario: Scenario, base: HardwareProfile,
        make_runner: Callable[[HardwareProfile], Any], iterations: int, note: str, seed: int = 0,
        progress: Callable[[int, float], None] = lambda done, best: None) -> tuple[HardwareProfile, float, float]:
    """The calibrated profile, and the mean absolute log error before and after."""

    def loss(profile: HardwareProfile) -> float:
        runner = make_runner(profile)
        errors = [e for o in observations for e in log_errors(simulate(runner, scenario, o), o.measured)]
        return float(np.mean(errors))

    def objective(trial: optuna.Trial) -> float:
        values = {key: trial.suggest_float(key, low, high, log=True) for key, (low, high) in FREE.items()}
        return loss(with_figures(base, values, note))

    start = {key: min(max(getattr(base, key).value if getattr(base, key) else low, low), high)
             for key, (low, high) in FREE.items()}
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=min(20, iterations // 4))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial(start)
    study.optimize(objective, n_trials=iterations,
                   callbacks=[lambda s, t: progress(len(s.trials), s.best_value)])
    before = study.trials[0].value
    return with_figures(base, study.best_params, note), before, study.best_value


def error_rows(observation: Observation, predicted: dict[str, float | None]) -> list[dict[str, Any]]:
    """Per measured metric of one observation: the prediction, the measurement and the signed % error."""
    rows = []
    for key, real in observation.measured.items():
        guess = predicted.get(key)
        rows.append({"trial": observation.trial, "rate": observation.rate, "metric": key, "simulated": guess,
                     "measured": real, "error_pct": None if guess is None else 100.0 * (guess - real) / real})
    return rows


def error_table(observations: list[Observation], scenario: Scenario, runner) -> list[dict[str, Any]]:
    """Per observation and metric: simulated, measured and the signed % error."""
    return [row for o in observations for row in error_rows(o, simulate(runner, scenario, o))]


def error_summary(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float, int]]:
    """Per metric: median and worst absolute % error, and how many values they stand on (a load
    the simulator could not produce counts as infinitely wrong)."""
    out = {}
    for key in METRICS:
        errors = [math.inf if r["error_pct"] is None else abs(r["error_pct"]) for r in rows if r["metric"] == key]
        if errors:
            out[key] = (float(np.median(errors)), float(max(errors)), len(errors))
    return out
