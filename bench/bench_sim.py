"""Simulator speed, old code and new side by side: simulated requests and engine steps per CPU
second over the same loads, and whether every request's times came out the same.

The baseline is a git revision (default: the last one before the simulator took its decode
steps in runs); its runners/, objectives/ and search_spaces/ are extracted to a temporary
folder and each tree measures the loads in its own process (PYTHONPATH first). The loads are
the presets' typical configs at their nominal rate and at 4x it (near and past capacity, where
a study's capacity search spends its requests).

python bench/bench_sim.py [--baseline REV] [--repeat N]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "ce36372"  # before runners/sim/decode_run.py
BASE = {"max_prefill_tokens": 8192, "quantization": "w8a8", "kv_compression": 1.0}
LOADS = [  # scenario, engine, knobs, rate multiple of the nominal, requests
    ("customer-service", "mindie", {"batch_size": 834, "select_batch": "decode-first"}, 4, 4000),
    ("customer-service", "mindie", {"batch_size": 64, "select_batch": "prefill-first"}, 1, 2000),
    ("realtime-chat", "mindie", {"batch_size": 128, "select_batch": "decode-first"}, 4, 2000),
    ("code-completion", "vllm", {"batch_size": 256, "select_batch": "decode-first"}, 4, 4000),
    ("document-summary", "llamacpp", {"batch_size": 16}, 1, 1000),
    ("multi-turn-chat", "mindie", {"batch_size": 256, "select_batch": "decode-first"}, 1, 4000),
    ("content-generation", "vllm", {"batch_size": 512, "select_batch": "prefill-first"}, 1, 1000),
]


def _measure_loads(repeat: int) -> list[dict]:
    """In the tree on PYTHONPATH: each load's requests, steps, CPU seconds and result hash."""
    from objectives.scenario import load_scenario
    from runners.sim.runner import SimRunner

    rows = []
    for name, engine, knobs, multiple, requests in LOADS:
        scenario = load_scenario(name)
        workload = scenario.at_rate(scenario.nominal_rate * multiple)
        workload = workload.model_copy(update={"num_requests": requests})
        runner = SimRunner(engine=engine)
        config = BASE | knobs
        seconds = []
        for _ in range(repeat):
            start = time.process_time()
            measurement = runner.run(config, workload)
            seconds.append(time.process_time() - start)
        digest = hashlib.sha256()
        for times in (measurement.send_s, measurement.first_token_s, measurement.finish_s):
            digest.update(times.tobytes())
        rows.append(
            {
                "load": f"{name} {engine} x{multiple}",
                "requests": int(measurement.sent),
                "steps": int(measurement.extra.get("steps", 0)),
                "cpu_s": statistics.median(seconds),
                "hash": digest.hexdigest()[:16],
                "core": getattr(importlib.import_module("runners.sim"), "CORE", "source"),
            }
        )
    return rows


def _in_tree(tree: Path, repeat: int, pure: bool = False) -> list[dict]:
    """Each load measured by the tree in its own process (pure: its source, not its compiled
    core: runners/sim/compiled.py)."""
    env = os.environ | {"PYTHONPATH": str(tree)} | ({"AUTOTUNE_PURE_PYTHON": "1"} if pure else {})
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_sim; "
        "print(json.dumps(bench_sim._measure_loads(int(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "bench"), str(repeat)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _extract(revision: str, into: Path) -> None:
    archive = into / "tree.tar"
    subprocess.run(
        ["git", "archive", "-o", str(archive), revision, "runners", "objectives", "search_spaces"],
        cwd=ROOT,
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the old code")
    parser.add_argument("--repeat", type=int, default=3, help="runs per load (median CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        _extract(args.baseline, Path(work))
        old = _in_tree(Path(work), args.repeat)
    source = _in_tree(ROOT, args.repeat, pure=True)
    new = _in_tree(ROOT, args.repeat)
    print(f"new tree's simulator: {new[0]['core']}")
    print(
        f"{'load':38} {'requests':>8} {'steps':>9} {'old req/CPU-s':>13} "
        f"{'new, source':>11} {'new req/CPU-s':>13} {'new steps/CPU-s':>15} {'ratio':>6}  same"
    )
    totals = {"old": 0.0, "source": 0.0, "new": 0.0, "requests": 0}
    for before, interpreted, after in zip(old, source, new, strict=True):
        same = {(row["hash"], row["steps"]) for row in (before, interpreted, after)}
        for key, row in (("old", before), ("source", interpreted), ("new", after)):
            totals[key] += row["cpu_s"]
        totals["requests"] += after["requests"]
        print(
            f"{after['load']:38} {after['requests']:>8} {after['steps']:>9} "
            f"{before['requests'] / before['cpu_s']:>13,.0f} "
            f"{interpreted['requests'] / interpreted['cpu_s']:>11,.0f} "
            f"{after['requests'] / after['cpu_s']:>13,.0f} "
            f"{after['steps'] / after['cpu_s']:>15,.0f} "
            f"{before['cpu_s'] / after['cpu_s']:>5.2f}x  {'yes' if len(same) == 1 else 'NO'}"
        )
    per_s = {key: totals["requests"] / totals[key] for key in ("old", "source", "new")}
    print(
        f"all loads: {per_s['old']:,.0f} (old) -> {per_s['source']:,.0f} (new, source) -> "
        f"{per_s['new']:,.0f} (new) simulated requests per CPU second "
        f"({totals['old'] / totals['new']:.2f}x; baseline {args.baseline})"
    )


if __name__ == "__main__":
    main()
