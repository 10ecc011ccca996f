"""Wall time of the default study, as a user runs it: `autotune --scenario customer-service`.

python bench/bench_study.py [scenario ...]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

BUDGET_S = 60.0


def main() -> None:
    scenarios = sys.argv[1:] or ["customer-service"]
    for scenario in scenarios:
        with tempfile.TemporaryDirectory() as work:
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-m", "tuner", "--scenario", scenario],
                cwd=work,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - start
        status = {0: "ok", 3: "no feasible config"}.get(
            result.returncode, f"exit {result.returncode}"
        )
        print(
            f"{scenario:20} default study (50 trials): {wall:6.1f} s wall, "
            f"{wall / BUDGET_S:.2f} of the one-minute budget, {status}"
        )


if __name__ == "__main__":
    main()
