"""Wall time of the default study, as a user runs it: `autotune --scenario customer-service`,
and what the search after the study's trials costs: the same run with `--polish 0` (no arm
refinement, no polish) beside it, and their ratio. `--repeat N` alternates the two N times
and prints the medians (this machine is shared: one pair of runs moves by 10%).

python bench/bench_study.py [scenario ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

BUDGET_S = 60.0


def _run(scenario: str, *extra: str) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "tuner", "--scenario", scenario, "--no-html", *extra],
            cwd=work,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
    status = {0: "ok", 3: "no feasible config"}.get(result.returncode, f"exit {result.returncode}")
    return wall, status


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*", default=["customer-service"])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    for scenario in args.scenarios:
        walls, bares, statuses = [], [], set()
        for _ in range(args.repeat):
            wall, status = _run(scenario)
            bare, _ = _run(scenario, "--polish", "0")
            walls.append(wall)
            bares.append(bare)
            statuses.add(status)
        wall, bare = statistics.median(walls), statistics.median(bares)
        runs = f" (median of {args.repeat}: {', '.join(f'{w:.1f}' for w in walls)})"
        print(
            f"{scenario:20} default study (50 trials, then arms and polish): {wall:6.1f} s wall"
            f"{runs if args.repeat > 1 else ''}, {wall / BUDGET_S:.2f} of the one-minute "
            f"budget, {'/'.join(sorted(statuses))}; with --polish 0 {bare:6.1f} s "
            f"({wall / bare:.2f}x)"
        )


if __name__ == "__main__":
    main()
