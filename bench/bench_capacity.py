"""Simulator cost of a capacity trial: wall time of one capacity search per preset and config,
as a ratio to one fixed-rate trial (the nominal rate only) measured in the same run.

    python bench/bench_capacity.py

Goal: a capacity trial under about 1 s on a 2-core machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from objectives.scenario import Load, load_scenario, preset_names
from runners.load.capacity import evaluate
from runners.sim.runner import DEFAULTS, SimRunner

CONFIGS = {
    "batch 16, prefill-first": dict(
        batch_size=16, select_batch="prefill-first", max_prefill_batch_size=16
    ),
    "batch 64, decode-first": dict(
        batch_size=64, select_batch="decode-first", max_prefill_batch_size=50
    ),
    "batch 256, w8a8": dict(
        batch_size=256, select_batch="prefill-first", max_prefill_batch_size=50, quantization="w8a8"
    ),
}
GOAL_S = 1.0
REPEATS = 3


def timed(runner, config, scenario) -> tuple[float, dict]:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        metrics = evaluate(runner, config, scenario).metrics
        times.append(time.perf_counter() - start)
    return statistics.median(times), metrics


def main() -> None:
    runner = SimRunner()
    print(
        f"{'preset':19} {'config':25} {'steps':>5} {'capacity':>9} {'fixed s':>8} "
        f"{'capacity s':>10} {'ratio':>6}"
    )
    worst = []
    for name in preset_names():
        scenario = load_scenario(name)
        fixed = scenario.model_copy(update={"load": Load(mode="fixed")})
        for label, knobs in CONFIGS.items():
            config = DEFAULTS | knobs
            fixed_s, _ = timed(runner, config, fixed)
            capacity_s, metrics = timed(runner, config, scenario)
            worst.append(capacity_s)
            rate = metrics.get("capacity_rate")
            shown_rate = "-" if rate is None else format(rate, ".3g")
            print(
                f"{name:19} {label:25} {len(metrics.get('capacity_steps', [])):>5} "
                f"{shown_rate:>9} {fixed_s:>8.3f} {capacity_s:>10.3f} "
                f"{capacity_s / fixed_s:>5.1f}x"
            )
    print(
        f"capacity trial: median {statistics.median(worst):.2f} s, slowest {max(worst):.2f} s "
        f"(goal {GOAL_S:g} s; slowest / goal {max(worst) / GOAL_S:.2f})"
    )


if __name__ == "__main__":
    main()
