"""Prefill/decode disaggregation on the simulator, beside the seed article.

    python bench/bench_disaggregation.py [caveat] [seed] [cost]

caveat: the seed's "below about 256 input tokens disaggregation may not pay", as
  tests/test_disaggregation.py checks it: the best SLA-feasible capacity per chip
  (runners.load.capacity's capacity_output_tokens_per_s) of co-located replicas and of xPyD splits
  over one small grid, for short prompts (128-256 tokens) and for long ones (4096 tokens) under a
  tight TPOT p99 bound, per engine and chip budget.
seed: the article's comparison on its workload (customer-service, 512/128 tokens) at 8 chips:
  8 co-located replicas against 2 prefill + 6 decode instances (and one chip alone, the
  article's "single instance"): TTFT and TPOT p50 at the nominal rate, and the maximum
  throughput that meets the preset's SLA per chip and for the 8 chips, beside the article's.
cost: wall time of one trial (`runners.load.capacity.evaluate`) of a disaggregated config against
  the co-located config it is matched with (same knobs and chips), median of REPEATS, one at a
  time. Goal: a disaggregated trial costs at most about 2x a co-located one.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from objectives.scenario import Scenario
from runners.load.capacity import evaluate
from runners.sim.runner import SimRunner
from testing.disaggregation import (
    QUANT,
    best_capacity_per_chip,
    caveat_grid,
    long_prompts,
    seed_customer_service,
    short_prompts,
)

HARDWARE = "ascend-910b2"
REPEATS = 5
COST_GOAL = 2.0
SEEDS = (0, 1, 2)  # workload draws: one draw's capacities move by up to ~10%

# The seed article (Qwen2-7B on MindIE, 2 prefill + 6 decode NPUs against one instance).
ARTICLE = {"ttft_p50_ms": (420, 230), "tpot_p50_ms": (38, 32), "max_throughput": (1200, 2100)}


def co_located(batch: int, select: str) -> dict[str, Any]:
    return QUANT | {"deployment": "co-located", "batch_size": batch, "select_batch": select}


def disaggregated(prefill: int, decode: int, batch: int, prefill_batch: int) -> dict[str, Any]:
    return QUANT | {
        "deployment": "disaggregated",
        "select_batch": "prefill-first",
        "batch_size": batch,
        "prefill_instances": prefill,
        "decode_instances": decode,
        "prefill_batch_size": prefill_batch,
        "prefill_memory_share": 0.8,
        "decode_memory_share": 0.8,
    }


def caveat() -> None:
    print("== caveat: best SLA-feasible capacity per chip (output tok/s per chip) ==")
    print("   the grids and scenarios of tests/test_disaggregation.py; per workload draw")
    print(f"{'scenario':14} {'engine':7} {'chips':>5} {'draw':>4} {'co-located':>11} "
          f"{'disagg.':>8} {'dis/colo':>8}")  # fmt: skip
    # The 910B2 for both engines at 4 and 8 chips, and vLLM on a GPU profile (h200) at 8.
    cases = [(engine, HARDWARE, chips) for engine in ("mindie", "vllm") for chips in (4, 8)]
    cases.append(("vllm", "h200", 8))
    for kind, make in (("short", short_prompts), ("long", long_prompts)):
        for engine, hardware, chips in cases:
            runner = SimRunner(engine=engine, hardware=hardware, chips=chips)
            label = engine if hardware == HARDWARE else f"{engine}@{hardware}"
            colo_configs, dis_configs = caveat_grid(kind, chips)
            sums = [0.0, 0.0]
            for draw in SEEDS:
                chosen = make(seed=draw)
                colo = best_capacity_per_chip(runner, colo_configs, chosen)
                dis = best_capacity_per_chip(runner, dis_configs, chosen)
                sums = [sums[0] + colo, sums[1] + dis]
                print(
                    f"{chosen.name:14} {label:7} {chips:5d} {draw:4d} {colo:11.0f} "
                    f"{dis:8.0f} {dis / max(colo, 1e-9):8.2f}",
                    flush=True,
                )
            print(
                f"{'':14} {'':7} {'':5} {'all':>4} {sums[0] / len(SEEDS):11.0f} "
                f"{sums[1] / len(SEEDS):8.0f} {sums[1] / max(sums[0], 1e-9):8.2f}",
                flush=True,
            )
    print("seed's direction: short prompts dis/colo < 1, long prompts with a tight TPOT > 1")


def seed() -> None:
    chosen = seed_customer_service()
    sla = f"TTFT p99 <= {chosen.sla.ttft_p99_ms:g} ms"
    print(
        f"== seed: customer-service (512/128 tokens, {chosen.nominal_rate:g} req/s per chip "
        f"nominal, {sla}), MindIE, {HARDWARE}, w8a8 =="
    )
    single = SimRunner(engine="mindie", hardware=HARDWARE, chips=1)
    eight = SimRunner(engine="mindie", hardware=HARDWARE, chips=8)
    seed_knobs = {"quantization": "w8a8", "kv_compression": 1.0, "max_prefill_tokens": 8192}
    print(
        f"{'batch':>5} {'select':13} {'deployment':20} {'TTFT p50':>8} {'TPOT p50':>8} "
        f"{'max tok/s/chip':>14} {'x 8 chips':>9}"
    )
    best: dict[str, tuple[float, str, float, float]] = {}
    for batch in (8, 16, 32, 64, 128):
        for select in ("prefill-first", "decode-first"):
            knobs = seed_knobs | {"batch_size": batch, "select_batch": select}
            # the article's memory split: prefill 60%, decode 80% of the NPU
            roles = {
                "prefill_instances": 2,
                "decode_instances": 6,
                "prefill_batch_size": batch,
                "prefill_memory_share": 0.6,
                "decode_memory_share": 0.8,
            }
            for name, runner, config in (
                ("1 instance (1 chip)", single, knobs),
                ("co-located x8", eight, knobs | {"deployment": "co-located"}),
                ("2P6D", eight, knobs | {"deployment": "disaggregated"} | roles),
            ):
                m = evaluate(runner, config, chosen).metrics
                per_chip = float(m.get("capacity_output_tokens_per_s") or 0.0)
                ttft, tpot = m.get("ttft_p50_ms", math.nan), m.get("tpot_p50_ms", math.nan)
                total = per_chip * runner.chips if runner.chips > 1 else math.nan
                print(
                    f"{batch:5d} {select:13} {name:20} {ttft:8.0f} {tpot:8.1f} {per_chip:14.0f} "
                    f"{total:9.0f}",
                    flush=True,
                )
                if per_chip > best.get(name, (-1.0,))[0]:
                    best[name] = (per_chip, f"batch {batch} {select}", ttft, tpot)
    print("best of the grid (highest max throughput that meets the SLA):")
    for name, (per_chip, where, ttft, tpot) in best.items():
        chips = 1 if name.startswith("1 instance") else 8
        print(
            f"  {name:20} {where:22} TTFT p50 {ttft:4.0f} ms, TPOT p50 {tpot:4.1f} ms, "
            f"{per_chip:5.0f} tok/s per chip, {per_chip * chips:6.0f} for {chips} chip(s)"
        )
    print(
        "article (one instance -> 2P6D): TTFT p50 {} -> {} ms, TPOT p50 {} -> {} ms, "
        "max throughput {} -> {} tok/s (per chip or for all chips: not said)".format(
            *ARTICLE["ttft_p50_ms"], *ARTICLE["tpot_p50_ms"], *ARTICLE["max_throughput"]
        )
    )


def timed(runner: SimRunner, config: dict[str, Any], chosen: Scenario) -> tuple[float, int]:
    """Median wall time of a trial, and the requests its loads measured."""
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        metrics = evaluate(runner, config, chosen).metrics
        times.append(time.perf_counter() - started)
    return statistics.median(times), int(metrics.get("capacity_requests_all_steps", 0))


def one_load(runner: SimRunner, config: dict[str, Any], chosen: Scenario) -> float:
    """Median wall time of one whole load at the nominal rate (no capacity search)."""
    workload = chosen.workload
    times = []
    with runner.session(config, workload) as session:
        for _ in range(REPEATS):
            started = time.perf_counter()
            session.measure(workload)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def cost() -> None:
    print(f"== cost: wall time, median of {REPEATS}, seconds ==")
    print("   trial: runners.load.capacity.evaluate; load: one load at the nominal rate;")
    print("   requests: measured by all of a trial's loads (one decode instance's, disaggregated)")
    cases = [
        ("customer-service", seed_customer_service(), 8, 2, 32, 16),
        ("customer-service", seed_customer_service(), 8, 2, 128, 16),
        ("customer-service", seed_customer_service(), 4, 1, 64, 16),
        ("customer-service", seed_customer_service(), 8, 4, 64, 16),
        ("long prompts", long_prompts(), 8, 6, 128, 4),
        ("short prompts", short_prompts(), 8, 2, 128, 16),
    ]
    print(f"{'scenario':17} {'engine':7} {'split':5} {'batch':>5} {'trial colo':>10} "
          f"{'dis':>6} {'ratio':>5} {'load ratio':>10} {'requests colo':>13} "
          f"{'dis':>6}")  # fmt: skip
    ratios = []
    for name, chosen, chips, prefill, batch, prefill_batch in cases:
        for engine in ("mindie", "vllm"):
            runner = SimRunner(engine=engine, hardware=HARDWARE, chips=chips)
            colo = co_located(batch, "prefill-first")
            dis = disaggregated(prefill, chips - prefill, batch, prefill_batch)
            colo_s, colo_n = timed(runner, colo, chosen)
            dis_s, dis_n = timed(runner, dis, chosen)
            load_ratio = one_load(runner, dis, chosen) / one_load(runner, colo, chosen)
            ratios.append(dis_s / colo_s)
            split = f"{prefill}P{chips - prefill}D"
            print(
                f"{name:17} {engine:7} {split:5} {batch:5d} {colo_s:10.3f} {dis_s:6.3f} "
                f"{dis_s / colo_s:5.2f} {load_ratio:10.2f} {colo_n:13d} {dis_n:6d}",
                flush=True,
            )
    print(
        f"trial ratio median {statistics.median(ratios):.2f}, worst {max(ratios):.2f} "
        f"(goal <= {COST_GOAL:g})"
    )


def main() -> None:
    sections = {"caveat": caveat, "seed": seed, "cost": cost}
    chosen = sys.argv[1:] or list(sections)
    for name in chosen:
        if name not in sections:
            raise SystemExit(f"unknown section {name!r}: choose from {', '.join(sections)}")
        sections[name]()


if __name__ == "__main__":
    main()
