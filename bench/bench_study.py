"""Wall time of the default study, as a user runs it: `autotune --scenario customer-service`,
and what the search after the study's trials costs: the same run with `--polish 0` (no arm
refinement, no polish) beside it, and their ratio.

python bench/bench_study.py [scenario ...]
"""

from __future__ import annotations

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
    scenarios = sys.argv[1:] or ["customer-service"]
    for scenario in scenarios:
        wall, status = _run(scenario)
        bare, _ = _run(scenario, "--polish", "0")
        print(
            f"{scenario:20} default study (50 trials, then arms and polish): {wall:6.1f} s wall, "
            f"{wall / BUDGET_S:.2f} of the one-minute budget, {status}; with --polish 0 "
            f"{bare:6.1f} s ({wall / bare:.2f}x)"
        )


if __name__ == "__main__":
    main()
