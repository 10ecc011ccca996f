"""Multi-fidelity search on a real engine: how many real trials `--screen sim` needs to reach
what a plain real study reaches with its whole budget.

On llama-server with a tiny random Qwen2 (one thread) and a tight SLA, over a space of 12
configs:
1. ground truth: every config run for real once (the grid), its best capacity;
2. a plain real study (TPE, the default) with the whole budget, per seed;
3. a screened study (`--screen sim`, this CPU's measured profile, recalibrated as real trials
   arrive), per seed.
Printed per run: the real trials each needed to reach 95% of the grid's best capacity.

`--proxy`: the same question without noise, the simulator standing in for the engine. The
"engine" is the simulator with engine figures unlike the screen's profile (h100 as shipped);
the target is 95% of the best capacity a plain TPE study reaches with its whole budget
(customer-service, vLLM's knobs); the screened study recalibrates on what it measures.

    python bench/bench_screen.py [--engines DIR] [--seeds 3] [--budget 8]
    python bench/bench_screen.py --proxy [--seeds 3] [--budget 30]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testing.engines import ENGINES_DIR, engine_executable, engine_scenario, llama_settings
from testing.tiny_model import build_tiny_qwen2

SPACE = {
    "batch_size": {"choices": [1, 2, 4, 8, 16, 32]},
    "quantization": {"choices": ["bf16", "w8a8"]},
    "max_prefill_tokens": {"value": 512},
    "kv_compression": {"value": 1.0},
}
TARGET = 0.95


def autotune(work: Path, *args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tuner", *args], cwd=work, capture_output=True, text=True
    )
    if done.returncode not in (0, 3):
        sys.exit(f"autotune failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def capacities(work: Path, study: str) -> list[float]:
    """Capacity (output tok/s) of each real trial in order; 0 for one that missed the SLA or
    failed."""
    trials = optuna.load_study(study_name=study, storage=f"sqlite:///{work / 'studies.db'}").trials
    return [
        t.values[1] if t.values and t.user_attrs.get("status") == "feasible" else 0.0
        for t in trials
    ]


def trials_to(target: float, caps: list[float]) -> str:
    best = 0.0
    for n, cap in enumerate(caps, 1):
        best = max(best, cap)
        if best >= target:
            return str(n)
    return f">{len(caps)}"


# The stand-in engine: h100's device figures, engine overheads and efficiencies the profile lacks.
PROXY_ENGINE = {
    "mfu": 0.45,
    "mbu": 0.55,
    "decode_step_overhead_ms": 6.0,
    "prefill_step_overhead_ms": 25.0,
    "per_sequence_overhead_ms": 0.2,
    "request_latency_ms": 3.0,
}


def proxy(seeds: int, budget: int) -> None:
    from runners.sim.calibration import with_figures
    from runners.sim.profiles import load_hardware, load_model
    from runners.sim.runner import SimRunner
    from search_spaces.space import SearchSpace
    from testing.disaggregation import seed_customer_service
    from tuner.samplers import make_sampler
    from tuner.screen import Screen
    from tuner.study import StudyRun
    from tuner.trials import run_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scenario = seed_customer_service()  # as its table was measured: no system prompt
    space = SearchSpace.load("vllm").fit_workload(scenario.workload)
    model, profile = load_model("qwen2-7b"), load_hardware("h100")
    engine = SimRunner("vllm", model, with_figures(profile, PROXY_ENGINE, "the stand-in engine"))
    print(
        f"{'seed':>4} {'plain best tok/s':>17} {'plain trials to 95%':>20} "
        f"{'screened trials to 95%':>23} {'screened best':>14} {'wall s':>7}"
    )
    for seed in range(seeds):
        plain = optuna.create_study(
            directions=["minimize", "maximize"], sampler=make_sampler("tpe", seed, space, budget)
        )
        run = StudyRun(plain, scenario, space, engine, storage=None)
        for _ in range(budget):
            run_trial(run, plain.ask())
        caps = [
            t.values[1] if t.values and t.user_attrs.get("status") == "feasible" else 0.0
            for t in plain.trials
        ]
        target = TARGET * max(caps)
        started = time.perf_counter()
        screened = optuna.create_study(
            directions=["minimize", "maximize"], sampler=make_sampler("tpe", seed, space, budget)
        )
        screened.set_user_attr("scenario", scenario.model_dump(mode="json"))
        screen = Screen(
            SimRunner("vllm", model, profile),
            scenario,
            space,
            trials_per_round=20,
            calibration_iterations=40,
            seed=seed,
        )
        screen.record = optuna.create_study(directions=["minimize", "maximize"])
        run = StudyRun(screened, scenario, space, engine, storage=None, screen=screen)
        found = []
        while len(screened.trials) < budget:
            screen.propose(screened)
            report = run_trial(run, screened.ask())
            found.append(report.values[1] if report.values and report.status == "feasible" else 0.0)
            if max(found) >= target:
                break
        print(
            f"{seed:4} {max(caps):17.0f} {trials_to(target, caps):>20} "
            f"{trials_to(target, found):>23} {max(found):14.0f} "
            f"{time.perf_counter() - started:7.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=Path, default=ENGINES_DIR)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int)
    parser.add_argument(
        "--proxy", action="store_true", help="the simulator stands in for the engine"
    )
    args = parser.parse_args()
    if args.proxy:
        return proxy(args.seeds, args.budget or 30)
    args.budget = args.budget or 8
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_qwen2(work / "tiny")
        data = engine_scenario(requests=32, rate=8.0, ttft_ms=40).model_dump(mode="json")
        data["load"] |= {"max_rate": 2048, "max_trial_s": 60}
        (work / "scenario.yaml").write_text(yaml.safe_dump(data))
        (work / "runner.yaml").write_text(
            yaml.safe_dump(
                llama_settings(
                    engine_executable("llamacpp", args.engines),
                    model,
                    work / "logs",
                    work / "gguf",
                )
            )
        )
        (work / "space.yaml").write_text(yaml.safe_dump({"knobs": SPACE}))
        common = [
            "--scenario",
            "scenario.yaml",
            "--runner",
            "llamacpp",
            "--runner-config",
            "runner.yaml",
            "--space",
            "space.yaml",
            "--storage",
            "sqlite:///studies.db",
            "--no-html",
            # --trials the study's alone: what the bench counts to 95%
            "--polish",
            "0",
            "--repeats",
            "0",
        ]
        autotune(work, "profile-hardware", "--model", str(model), "-o", "cpu.yaml")
        configs = len(SPACE["batch_size"]["choices"]) * len(SPACE["quantization"]["choices"])
        wall = autotune(
            work, *common, "--sampler", "grid", "--trials", str(configs), "--study", "grid"
        )
        grid = capacities(work, "grid")
        target = TARGET * max(grid)
        print(
            f"grid: {configs} configs in {wall:.0f} s; best capacity {max(grid):.0f} tok/s; "
            f"target {target:.0f} (95%); configs reaching it: {sum(c >= target for c in grid)}"
        )
        print(f"{'run':24} {'real trials to 95%':>19} {'best tok/s':>11} {'wall s':>7}")
        for seed in range(args.seeds):
            for label, extra in (
                ("plain TPE", []),
                ("--screen sim", ["--screen", "sim", "--screen-hardware", "cpu.yaml"]),
            ):
                study = f"{label.strip('-').replace(' ', '-')}-{seed}"
                wall = autotune(
                    work,
                    *common,
                    "--trials",
                    str(args.budget),
                    "--seed",
                    str(seed),
                    "--study",
                    study,
                    *extra,
                )
                caps = capacities(work, study)
                print(
                    f"{label + f' seed {seed}':24} {trials_to(target, caps):>19} "
                    f"{max(caps):11.0f} {wall:7.0f}"
                )


if __name__ == "__main__":
    main()
