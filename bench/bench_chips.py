"""The chip-budget comparison over seeds (issue 28, item 3), on the simulator: for each seed,
`autotune --scenario customer-service --chips 8 --seed N` as a user runs it (one chip's study
first, then the chip budget's), the verdict it prints, each deployment's best per chip and the
trials each deployment got, and the run's wall time.

The reference it is read against: the best per-chip throughput of each deployment over all the
seeds' studies (bench/README), so a seed that leaves one side short shows as a gap to the
best any seed found.

    python bench/bench_chips.py [--case customer-service|short|long] [--chips N] [--seeds 0 1 2]

The cases are issue 28's: the customer-service preset (its TPOT p99 bound of 100 ms) on the
910B2, and the disaggregation caveat's short prompts on the 910B2 and long prompts on the h200
(testing.disaggregation), written to a scenario file as a user would.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from objectives.scenario import Scenario, load_scenario
from runners.sim.runner import SimRunner
from testing.disaggregation import best_capacity_per_chip, caveat_grid, long_prompts, short_prompts
from tuner.report import best_by_deployment
from tuner.study import trial_knobs

CASES = {  # the scenario, the hardware profile and the engine; the caveat's grid kind
    "customer-service": (lambda: load_scenario("customer-service"), "ascend-910b2", "mindie", None),
    "short": (short_prompts, "ascend-910b2", "mindie", "short"),
    "long": (long_prompts, "h200", "vllm", "long"),
}


def grid_reference(case: str, chips: int) -> dict[str, float]:
    """Each deployment's best per chip over the caveat's small grid (testing.disaggregation),
    where the case has one: issue 28 stated its findings against it."""
    make, hardware, engine, kind = CASES[case]
    if kind is None:
        return {}
    runner = SimRunner(engine=engine, hardware=hardware, chips=chips)
    co_located, disaggregated = caveat_grid(kind, chips)
    return {
        "co-located": best_capacity_per_chip(runner, co_located, make()),
        "disaggregated": best_capacity_per_chip(runner, disaggregated, make()),
    }


def run(case: str, chips: int, seed: int) -> tuple[str, dict[str, float], dict[str, int], float]:
    """The printed verdict, each deployment's best per chip, its trial count, the wall time."""
    make, hardware, engine, _ = CASES[case]
    chosen: Scenario = make()
    with tempfile.TemporaryDirectory() as work:
        data = chosen.model_dump(mode="json", exclude_none=True)
        data.setdefault("quality", "none")
        (Path(work) / "scenario.yaml").write_text(yaml.safe_dump(data))
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "tuner", "--scenario", "scenario.yaml", "--chips", str(chips),
             "--hardware", hardware, "--engine", engine, "--seed", str(seed), "--no-html",
             "--export", "export.yaml"],
            cwd=work, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - started
        if done.returncode not in (0, 3):
            raise SystemExit(f"seed {seed}: exit {done.returncode}: {done.stderr[-2000:]}")
        verdict = next(
            (line.strip() for line in done.stdout.splitlines() if line.strip().startswith("On ")),
            "(no verdict printed)",
        )
        storage = f"sqlite:///{Path(work) / 'studies.db'}"
        name = next(n for n in optuna.get_all_study_names(storage) if n.endswith(f".{chips}chips"))
        study = optuna.load_study(study_name=name, storage=storage)
        best = best_by_deployment(study, chosen) or {}
        found = {arm: t.values[1] for arm, t in best.items() if t is not None}
        counts: dict[str, int] = {}
        for t in study.trials:
            arm = str(trial_knobs(study, t).get("deployment")) if "knobs" in t.user_attrs else "?"
            counts[arm] = counts.get(arm, 0) + 1
        return verdict, found, counts, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="customer-service")
    parser.add_argument("--chips", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.chips < 2:
        parser.error("--chips must be at least 2: one chip has no deployments to compare")
    grid = grid_reference(args.case, args.chips)
    if grid:
        margin = grid["disaggregated"] / max(grid["co-located"], 1e-9) - 1
        print(
            f"the caveat's grid, per chip: co-located {grid['co-located']:.0f}, disaggregated "
            f"{grid['disaggregated']:.0f} (disaggregated {margin:+.1%})",
            flush=True,
        )
    rows = []
    for seed in args.seeds:
        rows.append((seed, *run(args.case, args.chips, seed)))
        print(f"seed {seed}: {rows[-1][1]}", flush=True)
    reference = {
        arm: max([found.get(arm, 0.0) for _, _, found, _, _ in rows] + [grid.get(arm, 0.0)])
        for arm in ("co-located", "disaggregated")
    }
    margin = reference["disaggregated"] / max(reference["co-located"], 1e-9) - 1
    print(
        f"reference (the best over the seeds and the grid, per chip): co-located "
        f"{reference['co-located']:.0f}, disaggregated {reference['disaggregated']:.0f} "
        f"(disaggregated {margin:+.1%})"
    )
    for seed, verdict, found, counts, wall in rows:
        sides = ", ".join(
            f"{arm} {found.get(arm, 0):.0f} ({found.get(arm, 0) / max(reference[arm], 1e-9):.0%} "
            f"of the best, {counts.get(arm, 0)} trials in all)"
            for arm in reference
        )
        printed = found.get("disaggregated", 0) / max(found.get("co-located", 0), 1e-9) - 1
        print(f"seed {seed}: {wall:.0f} s; {sides}; disaggregated {printed:+.1%}\n  {verdict}")


if __name__ == "__main__":
    main()
