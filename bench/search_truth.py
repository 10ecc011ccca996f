"""Ground truth for bench/bench_search.py: every point of a scenario's grid, evaluated once.

Per scenario: every point of the default search space's grid (SearchSpace.grid(), what
`--sampler grid` walks: batch sizes in powers of two from 1 to the ceiling of what the KV cache
holds for the scenario's typical request (as the product searches), six prefill budgets, every
precision, both KV states and select-batch modes, prefill batches 1..64 within the batch: 4,032
runnable configs at a ceiling of 256) run as a trial runs (the capacity search on the default
simulator), once. Random scenarios send 32 requests per load step (`--random-requests`) and
search capacity to 10%: measured with one job on a shared 2-core machine, a grid then costs 30 s
(short chat) to 4.5 minutes (replies of ~1k tokens), about 2.5 minutes on average, so 10 random
scenarios' ground truth stays within ~30 CPU-minutes (at 200 requests and 5% it was 2.5-14
minutes a grid: 35-200 ms a config); presets and files keep their own request counts (1000: ~10
minutes a grid). The tables are cached in the user's cache folder
($XDG_CACHE_HOME/autotune/bench-search, else ~/.cache/autotune/bench-search; `--cache-dir`),
under a file named by a hash of the scenario's content (its name and description left out), the
grid, and the simulator's source and profile files (runners/sim/**/*.py and *.yaml,
runners/load/capacity.py, loadgen.py, measurement.py, workload.py, objectives/*.py and
search_spaces/engines.py), so any change to the simulator invalidates it. While a run evaluates
a grid it holds a `.lock` file next to it (its pid): another run waits for the table, and takes
the lock over if that process is gone.

`Table` is that grid as a tabular benchmark (NAS-Bench style) for the samplers to search.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume
from random_scenarios import sample_points

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible, objective_values
from runners.engines.process import pid_alive
from runners.load.capacity import evaluate
from runners.sim.runner import SimRunner
from search_spaces.space import SearchSpace

ROOT = Path(__file__).resolve().parents[1]
NUMERIC = ("batch_size", "max_prefill_tokens", "max_prefill_batch_size")
TARGET = 0.95
FEASIBILITY_SAMPLE = 48  # grid points a random scenario's feasibility check evaluates
SIM_SOURCES = (  # what a simulated trial's numbers depend on (the grid is in the key itself)
    "runners/sim/**/*.py",
    "runners/sim/**/*.yaml",
    "runners/load/capacity.py",
    "runners/load/loadgen.py",
    "runners/load/measurement.py",
    "runners/load/workload.py",
    "objectives/*.py",
    "search_spaces/engines.py",
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune" / "bench-search"


def simulator_hash() -> str:
    h = hashlib.sha256()
    for source in SIM_SOURCES:
        for path in sorted(ROOT.glob(source)):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


# --- ground truth ------------------------------------------------------------------------
def _space(scenario: Scenario) -> SearchSpace:
    """The product's space on the default simulator: the preset, the longest prompt's floor and
    the batch ceiling from what the KV cache holds (tuner/prepare.py)."""
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    ceiling = SimRunner().batch_ceiling(space, scenario.workload)
    return space if ceiling is None else space.with_ceiling("batch_size", *ceiling)


def _grid(scenario: Scenario) -> tuple[list[str], dict[str, list], dict]:
    space = _space(scenario)
    grid = space.grid()
    return list(grid), grid, space.fixed()


def _cache_name(scenario: Scenario, grid: dict, fixed: dict) -> str:
    content = scenario.model_dump(mode="json", exclude={"name", "description"})
    h = hashlib.sha256(json.dumps([content, grid, fixed], sort_keys=True).encode())
    h.update(simulator_hash().encode())
    return f"grid-{h.hexdigest()[:20]}.json"


_WORKER: dict = {}


def _init_worker(scenario_json: str) -> None:
    scenario = Scenario.model_validate_json(scenario_json)
    _WORKER.update(scenario=scenario, runner=SimRunner(), space=_space(scenario))


def _evaluate_point(config: dict) -> list | None:
    """[TTFT p99, capacity, SLA constraints, CPU seconds the trial took], or None where the
    config cannot run (refused, or its trial failed)."""
    started = time.process_time()
    scenario, runner, space = _WORKER["scenario"], _WORKER["runner"], _WORKER["space"]
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
    constraints = constraint_values(result.metrics, scenario.sla)
    return [values[0], values[1], constraints, time.process_time() - started]


def evaluate_points(scenario: Scenario, configs: list[dict], jobs: int) -> list:
    if jobs <= 1:
        _init_worker(scenario.model_dump_json())
        return [_evaluate_point(c) for c in configs]
    with Pool(jobs, initializer=_init_worker, initargs=(scenario.model_dump_json(),)) as pool:
        return pool.map(_evaluate_point, configs, chunksize=8)


def has_feasible_sample(scenario: Scenario, jobs: int) -> bool:
    """Whether a fixed sample of the grid holds an SLA-feasible config (then the grid does)."""
    _, grid, fixed = _grid(scenario)
    points = sample_points(
        grid,
        FEASIBILITY_SAMPLE,
        seed=0,
        keep=lambda p: p["max_prefill_batch_size"] <= p["batch_size"],
    )
    results = evaluate_points(scenario, [fixed | p for p in points], jobs)
    return any(r and is_feasible(r[2]) for r in results)


def _holder_alive(lock: Path) -> bool:
    """Whether the process whose pid `lock` holds still runs (False once the lock is gone)."""
    try:
        pid = int(lock.read_text())
    except FileNotFoundError:
        return False
    except ValueError:  # not a pid: nobody to wait for
        return False
    if pid <= 0 or pid == os.getpid():  # this run does not hold it: a pid reused since
        return False
    return pid_alive(pid)


def _take_lock(lock: Path) -> bool:
    """Hold `lock` unless a live process does: True when this run holds it now. A lock whose
    process is gone (a run killed while evaluating) is taken over."""
    mine = lock.with_name(f"{lock.name}.{os.getpid()}")
    mine.write_text(str(os.getpid()))
    try:
        while True:
            try:
                os.link(mine, lock)  # atomic, with its pid already in it; fails if it exists
                return True
            except FileExistsError:
                pass
            if _holder_alive(lock):
                return False
            if lock.exists():
                print(f"{lock}: the run that held it is gone; taking it over", file=sys.stderr)
                lock.unlink(missing_ok=True)
    finally:
        mine.unlink(missing_ok=True)


def ground_truth(
    label: str, scenario: Scenario, jobs: int, cache: Path
) -> dict[tuple, list | None]:
    keys, grid, fixed = _grid(scenario)
    path = cache / _cache_name(scenario, grid, fixed)
    lock = path.with_suffix(".lock")
    held = False
    while not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        held = _take_lock(lock)
        if held:
            break
        time.sleep(5)  # another run of the bench is evaluating it
    try:
        if path.exists():  # also where the run that held the lock finished it meanwhile
            table = json.loads(path.read_text())
        else:
            points = [
                dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())
            ]
            started = time.perf_counter()
            results = evaluate_points(scenario, [fixed | p for p in points], jobs)
            table = {
                json.dumps([p[k] for k in keys]): r for p, r in zip(points, results, strict=True)
            }
            cache.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(table))
            partial.replace(path)
            runnable = sum(r is not None for r in results)
            print(
                f"<!-- {label}: grid of {len(points)} configs ({runnable} runnable) evaluated in "
                f"{time.perf_counter() - started:.0f} s with {jobs} job(s) -> {path} -->",
                flush=True,
            )
    finally:
        if held:
            lock.unlink(missing_ok=True)
    return {tuple(json.loads(k)): v for k, v in table.items()}


# --- the grid as a table -----------------------------------------------------------------
class Table:
    def __init__(self, label: str, scenario: Scenario, jobs: int, cache: Path):
        self.label = label
        self.scenario = scenario
        self.keys, self.grid, _ = _grid(self.scenario)
        self.results = ground_truth(label, scenario, jobs, cache)
        feasible = [r for r in self.results.values() if r and is_feasible(r[2])]
        if not feasible:
            raise SystemExit(f"{label}: no config of the grid meets the SLA; nothing to find")
        self.best = max(r[1] for r in feasible)
        self.feasible_share = len(feasible) / sum(r is not None for r in self.results.values())
        self.target_share = sum(r[1] >= TARGET * self.best for r in feasible) / len(self.results)
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
            if key == "max_prefill_batch_size":  # at most the batch size, as SearchSpace.suggest
                index = min(index, max(i for i, v in enumerate(values) if v <= point["batch_size"]))
            point[key] = values[index]
        return point

    def describe(self) -> str:
        w, sla = self.scenario.workload, self.scenario.sla
        arrival = w.arrival.model_dump()
        kind = arrival.pop("kind")
        lengths = [
            f"{d.kind} {d.bounds[0]}..{d.bounds[1]}" for d in (w.input_tokens, w.output_tokens)
        ]
        slo = f"TTFT<={sla.ttft_p99_ms:g}ms" + (
            f" TPOT<={sla.tpot_p99_ms:g}ms" if sla.tpot_p99_ms else ""
        )
        if sla.min_success_rate:
            slo += f" ok>={sla.min_success_rate:g}"
        extra = ",".join(f"{k}={v:g}" for k, v in arrival.items())
        return (
            f"{kind}({extra}) in {lengths[0]} out {lengths[1]} {slo}, {w.num_requests} req; "
            f"best {self.best:.0f} tok/s, feasible {self.feasible_share:.0%} of runnable, "
            f">=95% {self.target_share:.1%} of grid"
        )
