"""Search efficiency against the grid: how many trials each sampler needs to find a good config.

    python bench/bench_search.py [--presets NAME ...] [--scenarios FILE ...]
        [--random-scenarios N --seed S] [--seeds 10] [--trials 50] [--samplers NAME ...] [--jobs 1]
        [--curve PNG]

Scenarios: preset names (`--presets`; all of them when no scenario is named any other way),
scenario files (`--scenarios`), and `--random-scenarios N` drawn with `--seed S` by
bench/random_scenarios.py over the space users have (chat to 8k-token documents, Poisson,
bursty gamma and closed-loop arrivals, TTFT/TPOT SLOs from tight to loose), each validated by
the Scenario model and redrawn until a sample of its grid holds an SLA-feasible config (the
count redrawn is printed). `--save-scenarios DIR` writes them as YAML for `--scenarios`.

Ground truth, per scenario (bench/search_truth.py): every point of the default search space's
grid (batch sizes in powers of two up to the ceiling of what the KV cache holds, as the product
searches) run as a trial runs on the default simulator, once, and cached in the user's cache
folder (`--cache-dir`) under a hash that any change to the simulator invalidates.

The samplers then search that same grid as a tabular benchmark (bench/search_samplers.py):
`sim-default`, `engine-default` (alias `default`), `tpe`, `gp`, `random`, `nsga2`,
`optuna-tpe`, `pso`, and the levers `polish-<sampler>`, `warm-<sampler>`, `gp-s5`/`tpe-s5`.
Two names that resolve to the same sampler share their runs (same seeds, same trials).

With --product-seeds N, a last row per scenario ("product") checks that the table stands for
the product: a real-engine study's default sampler in the product's own space (raw knob ranges,
not grid indices) and loop (each trial a capacity search on the live simulator standing in for
the engine), against the same grid's best.

Printed per scenario and sampler, over seeds 0..--seeds-1, and overall over every (scenario,
seed) pair: median trials to reach 95% of the grid's best SLA-feasible capacity (counted up to
--horizon trials, GP only up to --trials; ">N" when most never do), the share of pairs that reach
it within 25 and within 50 trials, the number of pairs with no SLA-feasible trial in the first
25, and the hypervolume of the feasible front after 10/25/50 trials as a share of the grid's
(Optuna's own hypervolume; TTFT p99 normalised by the SLA bound, capacity by the grid's best).

`--curve PNG` adds the tuning-efficiency curve (bench/search_curve.py): the median share of the
grid's best reached against trials and against seconds, for the presets and for the random
scenarios apart, as a table and as a plot written to PNG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import optuna
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_scenarios import draw
from search_curve import Curves
from search_curve import plot as plot_curves
from search_curve import table as curve_table
from search_samplers import resolved, run_optuna, run_product, run_pso
from search_truth import (
    FEASIBILITY_SAMPLE,
    TARGET,
    Table,
    default_cache_dir,
    has_feasible_sample,
)

from objectives.scenario import Scenario, load_scenario, preset_names
from objectives.scoring import is_feasible
from objectives.userfile import InputError
from tuner.samplers import SAMPLERS, describe

CHECKPOINTS = (10, 25, 50)
WITHIN = (25, 50)


def trials_to_target(table: Table, outcomes: list) -> float:
    for n, r in enumerate(outcomes, start=1):
        if r and is_feasible(r[2]) and r[1] >= TARGET * table.best:
            return n
    return float("inf")


def first_feasible(outcomes: list) -> float:
    for n, r in enumerate(outcomes, start=1):
        if r and is_feasible(r[2]):
            return n
    return float("inf")


# --- scenarios -----------------------------------------------------------------------------
def gather_scenarios(args) -> list[tuple[str, Scenario]]:
    named = args.presets is not None or args.scenarios or args.random_scenarios
    chosen: list[tuple[str, Scenario]] = []
    for name in args.presets if args.presets is not None else ([] if named else preset_names()):
        chosen.append((name, load_scenario(name)))
    for path in args.scenarios or []:
        scenario = load_scenario(path)
        chosen.append((scenario.name, scenario))
    if args.random_scenarios:
        started = time.perf_counter()
        drawn, redrawn = draw(
            args.random_scenarios,
            args.seed,
            lambda s: has_feasible_sample(s, args.jobs),
            num_requests=args.random_requests,
        )
        print(
            f"<!-- {len(drawn)} random scenarios drawn with seed {args.seed} in "
            f"{time.perf_counter() - started:.0f} s; {redrawn} redrawn (no SLA-feasible config "
            f"in a {FEASIBILITY_SAMPLE}-point sample of the grid) -->",
            flush=True,
        )
        if args.save_scenarios:
            folder = Path(args.save_scenarios)
            folder.mkdir(parents=True, exist_ok=True)
            for scenario in drawn:
                data = scenario.model_dump(mode="json", exclude_defaults=True)
                (folder / f"{scenario.name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        chosen += [(s.name, s) for s in drawn]
    return chosen


# --- the report ----------------------------------------------------------------------------
class Row:
    def __init__(self, horizon: int):
        self.horizon = horizon
        self.needed: list[float] = []
        self.feasible: list[float] = []
        self.hv: dict[int, list[float]] = {c: [] for c in CHECKPOINTS}
        self.seconds = 0.0

    def add(self, table: Table, outcomes: list) -> None:
        self.needed.append(trials_to_target(table, outcomes))
        self.feasible.append(first_feasible(outcomes))
        for c in CHECKPOINTS:
            self.hv[c].append(table.hypervolume(outcomes[:c]) / table.grid_hv)

    def extend(self, other: Row) -> None:
        self.horizon = min(self.horizon, other.horizon)
        self.needed += other.needed
        self.feasible += other.feasible
        for c in CHECKPOINTS:
            self.hv[c] += other.hv[c]
        self.seconds += other.seconds

    def cells(self) -> list[str]:
        median = statistics.median(self.needed)
        shown = f"{median:.0f}" if median != float("inf") else f">{self.horizon}"
        within = [f"{sum(n <= w for n in self.needed) / len(self.needed):.0%}" for w in WITHIN]
        none = sum(f > 25 for f in self.feasible)
        hv = [f"{np.mean(self.hv[c]):.2f}" for c in CHECKPOINTS]
        per_seed = self.seconds / len(self.needed)
        return [shown, *within, str(none), *hv, f"{per_seed:.1f}"]


HEADER = (
    ["scenario", "sampler", "median trials to 95%"]
    + [f"<={w}" for w in WITHIN]
    + ["no feasible in 25"]
    + [f"HV@{c}" for c in CHECKPOINTS]
    + ["s/seed"]
)


def markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def print_header() -> None:
    print(markdown_row(HEADER))
    print(markdown_row(["---"] * 2 + ["---:"] * (len(HEADER) - 2)), flush=True)


def torch_threads() -> None:
    """GP's model fits in one thread: on a shared machine more threads only contend."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# Names build_sampler takes besides the product's samplers (and warm- / polish- of any).
BENCH_SAMPLERS = ("sim-default", "engine-default", "default", "optuna-tpe", "gp-s5", "tpe-s5")
BENCH_SAMPLERS += ("pso", "product")


def _known_sampler(name: str) -> bool:
    for prefix in ("warm-", "polish-"):
        if name.startswith(prefix):
            return _known_sampler(name.removeprefix(prefix))
    return name in BENCH_SAMPLERS or name in SAMPLERS


def _writable_dir(path: Path) -> str | None:
    """Why `path` cannot take files (None: it can; a missing folder is created)."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{path}: {error.strerror}"
    return None


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line naming the flag, what would raise a traceback or run for ever."""
    limits = {
        "--random-scenarios": (args.random_scenarios, 0, 1000),
        "--random-requests": (args.random_requests, 1, 100_000),
        "--seed": (args.seed, 0, 2**32 - 1),
        "--seeds": (args.seeds, 1, 1000),
        "--trials": (args.trials, 1, 100_000),
        "--horizon": (args.horizon, 1, 100_000),
        "--jobs": (args.jobs, 1, 256),
        "--product-seeds": (args.product_seeds, 0, 1000),
    }
    for flag, (value, low, high) in limits.items():
        if not low <= value <= high:
            parser.error(f"{flag}: {value} is outside {low}..{high}")
    if "product" in args.samplers and not args.product_seeds:
        parser.error("--samplers: product runs --product-seeds seeds; give --product-seeds N")
    unknown = [name for name in args.samplers if not _known_sampler(name)]
    if unknown:
        allowed = ", ".join((*SAMPLERS, *BENCH_SAMPLERS))
        parser.error(
            f"--samplers: unknown {', '.join(unknown)}; allowed: {allowed} (warm-/polish-)"
        )
    for path in args.scenarios:
        if not Path(path).is_file():
            parser.error(f"--scenarios: {path} is not a file")
    if args.curve is not None and (args.curve.is_dir() or not args.curve.parent.is_dir()):
        parser.error(f"--curve: {args.curve} is not a file in an existing folder")
    for flag, folder in (
        ("--cache-dir", args.cache_dir),
        ("--save-scenarios", args.save_scenarios),
    ):
        why = None if folder is None else _writable_dir(Path(folder))
        if why is not None:
            parser.error(f"{flag}: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=None, help="preset names")
    parser.add_argument("--scenarios", nargs="*", default=[], help="scenario YAML files")
    parser.add_argument("--random-scenarios", type=int, default=0, metavar="N")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random scenarios")
    parser.add_argument(
        "--random-requests", type=int, default=32, help="requests per random scenario's step"
    )
    parser.add_argument("--save-scenarios", metavar="DIR", help="write random scenarios' YAML")
    parser.add_argument(
        "--samplers",
        nargs="*",
        default=["sim-default", "engine-default", "tpe", "gp", "random"],
    )
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument(
        "--horizon", type=int, default=300, help="trials run to count trials-to-target (not gp)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="processes for the grid")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: the user cache")
    parser.add_argument(
        "--product-seeds",
        type=int,
        default=0,
        help="also run the default sampler this many seeds in the product's own space and loop",
    )
    parser.add_argument(
        "--grids-only", action="store_true", help="evaluate (cache) the grids and stop"
    )
    parser.add_argument("--curve", type=Path, metavar="PNG", help="the efficiency curve's plot")
    args = parser.parse_args()
    check_args(parser, args)
    torch_threads()
    cache = args.cache_dir or default_cache_dir()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")  # Optuna's experimental-API notes
    print(f"<!-- sim-default: {describe('auto', simulated=True)} -->")
    print(f"<!-- engine-default: {describe('auto', simulated=False)} -->")
    scenarios = gather_scenarios(args)
    samplers = list(args.samplers) + ["product"] * (args.product_seeds > 0)
    overall = {s: Row(args.trials) for s in samplers}
    descriptions = []
    curves: dict[tuple[str, str], Curves] = {}
    presets = set(preset_names())
    if args.grids_only:
        for label, scenario in scenarios:
            print(f"- {label}: {Table(label, scenario, args.jobs, cache).describe()}", flush=True)
        return
    print_header()
    for label, scenario in scenarios:
        table = Table(label, scenario, args.jobs, cache)
        descriptions.append(f"- {label}: {table.describe()}")
        runs: dict[tuple[str, int], tuple[list, list[float], float]] = {}
        # a preset's copy (`NAME.suffix`, its requests changed) counts with the presets
        group = "presets" if label.split(".")[0] in presets else "random scenarios"
        for sampler in samplers:
            name = resolved(sampler)
            # Trials to the target are counted past the budget where that is cheap, so that a
            # sampler that needs more than `--trials` still gets a number (GP is too slow for it;
            # the swarm's budget is its 10 x 5 by definition).
            slow = "gp" in name or name == "product"
            horizon = (
                args.trials if slow else 50 if name == "pso" else max(args.trials, args.horizon)
            )
            row = Row(horizon)
            for seed in range(args.product_seeds if name == "product" else args.seeds):
                if (name, seed) not in runs:
                    started = time.perf_counter()
                    sampler_s = [0.0] * horizon  # the swarm's and the product's: not measured
                    if name == "pso":
                        outcomes = run_pso(table, seed, horizon)
                    elif name == "product":
                        outcomes = run_product(table, seed, horizon)
                    else:
                        outcomes, sampler_s = run_optuna(table, name, seed, horizon)
                    runs[name, seed] = outcomes, sampler_s, time.perf_counter() - started
                outcomes, sampler_s, seconds = runs[name, seed]
                row.add(table, outcomes)
                row.seconds += seconds
                if name != "product":
                    curves.setdefault((group, sampler), Curves()).add(
                        outcomes, sampler_s, table.best
                    )
            shown = sampler if name == sampler else f"{sampler} ({name})"
            print(markdown_row([label, shown, *row.cells()]), flush=True)
            overall[sampler].extend(row)
    if len(scenarios) > 1:
        print()
        print_header()
        for sampler, row in overall.items():
            label = f"all {len(scenarios)} scenarios"
            name = resolved(sampler)
            shown = sampler if name == sampler else f"{sampler} ({name})"
            print(markdown_row([label, shown, *row.cells()]))
    print()
    print("\n".join(descriptions))
    if args.curve:
        print()
        print(curve_table(curves))
        plot_curves(curves, args.curve)
        print(f"\n<!-- the curve: {args.curve} -->")


if __name__ == "__main__":
    try:
        main()
    except InputError as error:  # a scenario file that does not load: one line, as autotune's
        print(f"bench_search.py: error: {error}", file=sys.stderr)
        sys.exit(2)
