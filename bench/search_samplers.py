"""The samplers of bench/bench_search.py, run against a scenario's grid as a tabular benchmark.

The samplers search the grid of bench/search_truth.py as a tabular benchmark (NAS-Bench style):
numeric knobs are ordered indices into their grid values (so batch size keeps its log scale and
its order), categorical knobs stay categorical, and max_prefill_batch_size runs as at most the
batch size, as in the product. Each trial is told to Optuna as the product tells it: FAIL for a
config that cannot run, COMPLETE with the SLA as the trial's constraints otherwise. Samplers:
`sim-default` (what `autotune` picks on the simulator: resolve("auto", simulated=True), TPE),
`engine-default` (alias `default`; what it picks for a real engine: GP where PyTorch and SciPy
are installed, else TPE), `tpe` (the product's TPE), `gp`, `random`, `nsga2`, `optuna-tpe`
(Optuna's TPE as it comes), `pso` (msserviceprofiler's optimizer: 10 particles x 5 iterations,
one scalar fitness), and the levers: `polish-<sampler>` (a local polish around <sampler>:
bench/polish_sampler.py, a bench-only lever, measured here, not wired into the product),
`warm-<sampler>` (the engine's default and the seed article's configs first) and
`gp-s5`/`tpe-s5` (5 random startup trials instead of 10).

`product` is no table search: a real-engine study's default sampler in the product's own space
(raw knob ranges, not grid indices) and loop (each trial a capacity search on the live simulator
standing in for the engine).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import optuna
from optuna.trial import TrialState
from polish_sampler import PolishSampler
from search_truth import NUMERIC, Table, _space

from objectives.scoring import DIRECTIONS, is_feasible
from runners.sim.runner import SimRunner
from tuner.samplers import make_sampler, resolve
from tuner.storage import open_storage
from tuner.study import StudyRun, create_study
from tuner.trials import optimize, record_constraints

SAMPLER_ALIASES = {"default": "engine-default"}


def resolved(sampler: str) -> str:
    """The sampler a row runs: the two defaults are what `auto` picks here."""
    sampler = SAMPLER_ALIASES.get(sampler, sampler)
    if sampler == "sim-default":
        return resolve("auto", simulated=True)
    if sampler == "engine-default":
        return resolve("auto", simulated=False)
    for prefix in ("polish-", "warm-"):
        if sampler.startswith(prefix):
            return prefix + resolved(sampler.removeprefix(prefix))
    return sampler


# Warm starts (`warm-<sampler>`): the engine's documented defaults (MindIE: maxBatchSize 200,
# maxPrefillTokens 8192, maxPrefillBatchSize 50, bf16) and the seed article's configs (batch 4-8
# W8A8, 8-12 and W6A8 for code, 16-32 W4A16), each at its nearest grid point, tried first.
WARM_STARTS = (
    {"batch_size": 200, "max_prefill_tokens": 8192, "max_prefill_batch_size": 50},
    {"batch_size": 8, "quantization": "w8a8", "kv_compression": 0.5},
    {"batch_size": 16, "quantization": "w8a8"},
    {"batch_size": 32, "quantization": "w4a16"},
)
WARM_BASE = {
    "select_batch": "prefill-first",
    "max_prefill_tokens": 8192,
    "quantization": "bf16",
    "kv_compression": 1.0,
    "max_prefill_batch_size": 50,
}


def warm_params(table: Table, config: dict) -> dict:
    """A config as the table's trial parameters: numeric knobs at their nearest grid index."""
    config = WARM_BASE | config
    params: dict = {}
    for key in table.keys:
        values, value = table.grid[key], config[key]
        if key not in NUMERIC:
            params[key] = value if value in values else values[0]
            continue
        distance = [abs(np.log(v) - np.log(value)) for v in values]
        params[f"{key}_index"] = int(np.argmin(distance))
    return params


def build_sampler(name: str, seed: int, table: Table, trials: int) -> optuna.samplers.BaseSampler:
    if name == "optuna-tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name.startswith("warm-"):
        return build_sampler(name.removeprefix("warm-"), seed, table, trials)
    if name == "gp-s5":  # fewer random startup trials than GP's 10
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5)
    if name == "tpe-s5":
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, constant_liar=True, n_startup_trials=5
        )
    if name == "grid":  # the whole grid in a seeded random order, each point once
        space = {
            f"{key}_index" if key in NUMERIC else key: (
                list(range(len(values))) if key in NUMERIC else list(values)
            )
            for key, values in table.grid.items()
        }
        return optuna.samplers.GridSampler(space, seed=seed)
    if name.startswith("polish-"):
        inner = build_sampler(name.removeprefix("polish-"), seed, table, trials)
        return PolishSampler(inner, seed=seed)
    return make_sampler(name, seed, _space(table.scenario), trials)


def run_optuna(table: Table, sampler_name: str, seed: int, trials: int) -> tuple[list, list[float]]:
    """Each trial's outcome, and the seconds the sampler took for it (its ask and tell)."""
    study = optuna.create_study(
        directions=list(DIRECTIONS), sampler=build_sampler(sampler_name, seed, table, trials)
    )
    if sampler_name.startswith("warm-"):
        for config in WARM_STARTS:
            study.enqueue_trial(warm_params(table, config), skip_if_exists=True)
    outcomes, sampler_s = [], []
    for _ in range(trials):
        started = time.perf_counter()
        trial = study.ask()
        result = table.lookup(table.suggest(trial))
        if result is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            record_constraints(trial, result[2])
            study.tell(trial, result[:2])
        sampler_s.append(time.perf_counter() - started)
        outcomes.append(result)
    return outcomes, sampler_s


def run_product(table: Table, seed: int, trials: int) -> list:
    """The product's own loop rather than the table: a real-engine study's default sampler over
    the knobs' own ranges (batch size on a log scale up to the ceiling of what the KV cache
    holds, as in `_space`, not powers of two), each trial a capacity search on the live simulator
    standing in for the engine."""
    scenario, runner = table.scenario, SimRunner()
    space = _space(scenario)
    with tempfile.TemporaryDirectory() as folder:
        storage = open_storage(f"sqlite:///{folder}/studies.db")
        study = create_study(
            storage,
            "product",
            make_sampler("auto", seed, space, trials),
            scenario,
            runner.identity(),
        )
        optimize(StudyRun(study, scenario, space, runner, storage), trials, None)
        outcomes = [
            [t.values[0], t.values[1], t.user_attrs["sla_constraints"]]
            if t.state == TrialState.COMPLETE
            else None
            for t in study.trials
        ]
        storage.engine.dispose()
    return outcomes


def run_pso(table: Table, seed: int, trials: int, particles: int = 10) -> list:
    """msserviceprofiler's default: a particle swarm, 10 particles x 5 iterations, scalar
    fitness."""
    rng = np.random.default_rng(seed)
    sizes = np.array([len(table.grid[k]) for k in table.keys], dtype=float)
    position = rng.uniform(0, sizes - 1, size=(particles, len(sizes)))
    velocity = rng.uniform(-1, 1, size=position.shape) * (sizes - 1) / 4
    best_pos, best_fit = position.copy(), np.full(particles, -np.inf)
    swarm_pos, swarm_fit = position[0].copy(), -np.inf
    outcomes: list = []
    while len(outcomes) < trials:
        for p in range(particles):
            if len(outcomes) == trials:
                break
            index = np.clip(np.rint(position[p]), 0, sizes - 1).astype(int)
            result = table.lookup(
                {k: table.grid[k][i] for k, i in zip(table.keys, index, strict=True)}
            )
            outcomes.append(result)
            if result is None:
                fitness = -1e9
            elif is_feasible(result[2]):
                fitness = result[1]
            else:
                fitness = -max(result[2].values()) * table.best
            if fitness > best_fit[p]:
                best_fit[p], best_pos[p] = fitness, position[p].copy()
            if fitness > swarm_fit:
                swarm_fit, swarm_pos = fitness, position[p].copy()
        r1, r2 = rng.uniform(size=position.shape), rng.uniform(size=position.shape)
        velocity = (
            0.7 * velocity + 1.5 * r1 * (best_pos - position) + 1.5 * r2 * (swarm_pos - position)
        )
        position = np.clip(position + velocity, 0, sizes - 1)
    return outcomes
