"""Search efficiency against the grid: how many trials each sampler needs to find a good config.

    python bench/bench_search.py [--seeds 10] [--trials 50] [--presets NAME ...] [--samplers NAME ...] [--jobs 2]

Ground truth, per preset: every point of the default search space's grid (SearchSpace.grid(),
what `--sampler grid` walks: batch sizes 1..256 in powers of two, six prefill budgets, every
precision, both KV states and select-batch modes, prefill batches 1..64 within the batch) run
as a trial runs (the capacity search on the default simulator), once, cached under
bench/.cache/ by the content of the scenario, the space and the simulator's code.

The samplers then search that same grid as a tabular benchmark (NAS-Bench style): numeric
knobs are ordered indices into their grid values (so batch size keeps its log scale and its
order), categorical knobs stay categorical, and max_prefill_batch_size runs as at most the batch
size, as in the product. Each trial is told to Optuna as the product tells it: FAIL for a config
that cannot run, COMPLETE with the SLA as the trial's constraints otherwise. The particle swarm is the
baseline of msserviceprofiler's optimizer: 10 particles x 5 iterations, one scalar fitness
(capacity when the SLA holds, minus the violation otherwise).

With --product-seeds N, a last row per preset ("product") checks that the table stands for the
product: a real-engine study's default sampler in the product's own space (raw knob ranges, not
grid indices) and loop (each trial a capacity search on the live simulator standing in for the
engine), against the same grid's best.

Printed per preset and sampler: median trials to reach 95% of the grid's best SLA-feasible
capacity (counted up to --horizon trials; ">N" when most seeds never do), the share of seeds
that reach it within the budget (--trials, 50),
and the hypervolume of the feasible front after 10/25/50 trials as a share of the grid's
(Optuna's own hypervolume; TTFT p99 normalised by the SLA bound, capacity by the grid's best).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import sys
import tempfile
import time
import warnings
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from objectives.scenario import Scenario, load_scenario, preset_names  # noqa: E402
from objectives.scoring import DIRECTIONS, constraint_values, is_feasible, objective_values  # noqa: E402
from runners.capacity import evaluate  # noqa: E402
from runners.sim.runner import SimRunner  # noqa: E402
from search_spaces.space import SearchSpace  # noqa: E402
from tuner.samplers import describe, make_sampler, resolve  # noqa: E402
from tuner.storage import open_storage  # noqa: E402
from tuner.study import StudyRun, create_study, optimize, record_constraints  # noqa: E402

CACHE = ROOT / "bench" / ".cache"
NUMERIC = ("batch_size", "max_prefill_tokens", "max_prefill_batch_size")
TARGET = 0.95
CHECKPOINTS = (10, 25, 50)
SIM_SOURCES = (
    "runners/sim/*.py",
    "runners/sim/hardware/*.yaml",
    "runners/capacity.py",
    "runners/measurement.py",
    "runners/workload.py",
    "search_spaces/presets/mindie.yaml",
)


# --- ground truth ------------------------------------------------------------------------
def _space(scenario: Scenario) -> SearchSpace:
    return SearchSpace.load("mindie").fit_workload(scenario.workload)


def _grid(scenario: Scenario) -> tuple[list[str], dict[str, list], dict]:
    space = _space(scenario)
    grid = space.grid()
    return list(grid), grid, space.fixed()


def _cache_key(name: str, scenario: Scenario, grid: dict) -> str:
    h = hashlib.sha256(
        scenario.model_dump_json().encode() + json.dumps(grid, sort_keys=True).encode()
    )
    for source in SIM_SOURCES:  # what a simulated trial's numbers depend on
        for path in sorted(ROOT.glob(source)):
            h.update(path.read_bytes())
    return f"grid-{name}-{h.hexdigest()[:12]}.json"


def _evaluate_point(args):
    name, config = args
    scenario = load_scenario(name)
    runner = SimRunner()
    space = _space(scenario)
    reasons = space.violations(config, scenario.workload) + runner.violations(
        config, scenario.workload
    )
    if reasons:
        return None
    result = evaluate(runner, config, scenario)
    if result.fault is not None:
        return None
    values = objective_values(result.metrics, scenario)
    if values is None:
        return None
    return [values[0], values[1], constraint_values(result.metrics, scenario.sla)]


def ground_truth(name: str, jobs: int) -> dict[tuple, list | None]:
    scenario = load_scenario(name)
    keys, grid, fixed = _grid(scenario)
    path = CACHE / _cache_key(name, scenario, grid)
    if path.exists():
        table = json.loads(path.read_text())
    else:
        points = [dict(zip(keys, values)) for values in itertools.product(*grid.values())]
        started = time.perf_counter()
        with Pool(jobs) as pool:
            results = pool.map(_evaluate_point, [(name, fixed | p) for p in points], chunksize=8)
        table = {json.dumps([p[k] for k in keys]): r for p, r in zip(points, results)}
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table))
        print(
            f"  {name}: grid of {len(points)} configs evaluated in {time.perf_counter() - started:.0f} s "
            f"-> {path.relative_to(ROOT)}",
            flush=True,
        )
    return {tuple(json.loads(k)): v for k, v in table.items()}


# --- searching the table -----------------------------------------------------------------
class Table:
    def __init__(self, name: str, jobs: int):
        self.scenario = load_scenario(name)
        self.keys, self.grid, _ = _grid(self.scenario)
        self.results = ground_truth(name, jobs)
        feasible = [r for r in self.results.values() if r and is_feasible(r[2])]
        self.best = max(r[1] for r in feasible)
        self.bound = self.scenario.sla.ttft_p99_ms
        self.grid_hv = self.hypervolume(feasible)

    def lookup(self, point: dict) -> list | None:
        return self.results[tuple(point[k] for k in self.keys)]

    def hypervolume(self, results: list) -> float:
        points = [
            (r[0] / self.bound, -r[1] / self.best) for r in results if r and is_feasible(r[2])
        ]
        if not points:
            return 0.0
        return float(compute_hypervolume(np.array(points), np.array([1.0, 0.0])))

    def suggest(self, trial: optuna.Trial) -> dict:
        point = {}
        for key in self.keys:
            values = self.grid[key]
            if key not in NUMERIC:
                point[key] = trial.suggest_categorical(key, values)
                continue
            index = trial.suggest_int(f"{key}_index", 0, len(values) - 1)
            if (
                key == "max_prefill_batch_size"
            ):  # runs as at most the batch size, as SearchSpace.suggest does
                index = min(index, max(i for i, v in enumerate(values) if v <= point["batch_size"]))
            point[key] = values[index]
        return point


def run_optuna(table: Table, sampler_name: str, seed: int, trials: int) -> list:
    """`default` is what `autotune` uses here on a real engine (`auto`: GP where PyTorch and SciPy
    are installed, else `tpe`, the product's TPE): the table stands for real trials, where their
    count is the cost. `optuna-tpe` is Optuna's TPE as it comes."""
    if sampler_name == "optuna-tpe":
        sampler = optuna.samplers.TPESampler(seed=seed)
    else:
        sampler = make_sampler(
            "auto" if sampler_name == "default" else sampler_name,
            seed,
            _space(table.scenario),
            trials,
        )
    study = optuna.create_study(directions=list(DIRECTIONS), sampler=sampler)
    outcomes = []
    for _ in range(trials):
        trial = study.ask()
        result = table.lookup(table.suggest(trial))
        if result is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            record_constraints(trial, result[2])
            study.tell(trial, result[:2])
        outcomes.append(result)
    return outcomes


def run_product(table: Table, seed: int, trials: int) -> list:
    """The product's own loop rather than the table: a real-engine study's default sampler over
    the knobs' own ranges (batch size 1..256 on a log scale, not powers of two), each trial a
    capacity search on the live simulator standing in for the engine."""
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
    """msserviceprofiler's default: a particle swarm, 10 particles x 5 iterations, scalar fitness."""
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
            result = table.lookup({k: table.grid[k][i] for k, i in zip(table.keys, index)})
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


def trials_to_target(table: Table, outcomes: list) -> float:
    for n, r in enumerate(outcomes, start=1):
        if r and is_feasible(r[2]) and r[1] >= TARGET * table.best:
            return n
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=preset_names())
    parser.add_argument(
        "--samplers", nargs="*", default=["default", "tpe", "optuna-tpe", "nsga2", "random", "pso"]
    )
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument(
        "--horizon", type=int, default=300, help="trials run to count trials-to-target (not gp)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes for the grid")
    parser.add_argument(
        "--product-seeds",
        type=int,
        default=0,
        help="also run the default sampler this many seeds in the product's own space and loop",
    )
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")  # Optuna's experimental-API notes, once per product-row trial
    print(f"default sampler here, for real engines: {describe('auto', simulated=False)}")
    print(
        f"{'preset':18} {'sampler':8} {'median trials to 95%':>21} {'reached <=' + str(args.trials):>12} "
        + " ".join(f"{'HV@' + str(c):>7}" for c in CHECKPOINTS)
        + f" {'s/seed':>7}"
    )
    for name in args.presets:
        table = Table(name, args.jobs)
        medians = {}
        for sampler in args.samplers + ["product"] * (args.product_seeds > 0):
            started = time.perf_counter()
            needed, hv = [], {c: [] for c in CHECKPOINTS}
            # Trials to the target are counted past the budget where that is cheap, so that a
            # sampler that needs more than `--trials` still gets a number (GP is too slow for it;
            # the swarm's budget is its 10 x 5 by definition).
            slow = sampler in ("gp", "product") or (
                sampler == "default" and resolve("auto", simulated=False) == "gp"
            )
            horizon = (
                args.trials if slow else 50 if sampler == "pso" else max(args.trials, args.horizon)
            )
            for seed in range(args.product_seeds if sampler == "product" else args.seeds):
                if sampler == "pso":
                    outcomes = run_pso(table, seed, horizon)
                elif sampler == "product":
                    outcomes = run_product(table, seed, horizon)
                else:
                    outcomes = run_optuna(table, sampler, seed, horizon)
                needed.append(trials_to_target(table, outcomes))
                for c in CHECKPOINTS:
                    hv[c].append(table.hypervolume(outcomes[:c]) / table.grid_hv)
            median = statistics.median(needed)
            medians[sampler] = median
            shown = f"{median:.0f}" if median != float("inf") else f">{horizon}"
            reached = sum(n <= args.trials for n in needed) / len(needed)
            per_seed = (time.perf_counter() - started) / len(needed)
            print(
                f"{name:18} {sampler:8} {shown:>21} {reached:>12.0%} "
                + " ".join(f"{np.mean(hv[c]):>7.2f}" for c in CHECKPOINTS)
                + f" {per_seed:>7.1f}",
                flush=True,
            )
        if "default" in medians and "random" in medians:
            random, default = medians["random"], medians["default"]
            ratio = (
                f">{max(args.trials, args.horizon) / default:.1f}x"
                if random == float("inf")
                else f"{random / default:.1f}x"
            )
            print(
                f"{name:18} random / default median trials: {ratio} (grid best capacity "
                f"{table.best:.0f} tok/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
