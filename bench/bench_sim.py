"""Simulator speed: wall time of one 1,000-request trial per scenario and config (goal 0.2 s).

python bench/bench_sim.py
"""

from __future__ import annotations

import statistics
import time

from objectives.scenario import load_scenario
from runners.sim.runner import SimRunner

CONFIGS = {
    "batch 8, prefill-first": dict(
        batch_size=8, select_batch="prefill-first", max_prefill_batch_size=8
    ),
    "batch 32, decode-first": dict(
        batch_size=32, select_batch="decode-first", max_prefill_batch_size=32
    ),
    "batch 128, decode-first": dict(
        batch_size=128, select_batch="decode-first", max_prefill_batch_size=50
    ),
}
GOAL_S = 0.2


def main() -> None:
    runner = SimRunner()
    print(
        f"{'scenario':20} {'config':26} {'requests':>8} {'steps':>7} {'median s':>9} {'vs goal':>8}"
    )
    worst = 0.0
    for name in ("customer-service", "realtime-chat", "code-completion"):
        workload = load_scenario(name).workload.model_copy(update={"num_requests": 1000})
        for label, knobs in CONFIGS.items():
            config = {
                "max_prefill_tokens": 8192,
                "quantization": "bf16",
                "kv_compression": 1.0,
            } | knobs
            times = []
            for _ in range(5):
                start = time.perf_counter()
                m = runner.run(config, workload)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            worst = max(worst, median)
            print(
                f"{name:20} {label:26} {m.sent:>8} {m.extra['steps']:>7} {median:>9.3f} "
                f"{median / GOAL_S:>7.2f}x"
            )
    print(
        f"slowest median: {worst:.3f} s for 1,000 requests "
        f"(goal {GOAL_S} s; ratio {worst / GOAL_S:.2f})"
    )


if __name__ == "__main__":
    main()
