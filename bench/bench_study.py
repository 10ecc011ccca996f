"""The main job's wall and CPU time, as a user runs it (`autotune --scenario NAME`, its
defaults), beside an older revision of the code in the same run, and the export each writes.

For each scenario: the old tree (`--old`, a git revision, extracted with git archive), this tree
as installed (its simulator compiled), with `--source` this tree with its simulator run from
source (AUTOTUNE_PURE_PYTHON=1: runners/sim/compiled.py), and with `--one-process` this tree
with AUTOTUNE_SIM_PROCESSES=1 (its batches on one process: the same study, so the same export,
is the claim). The old tree runs as source: it is extracted, not built. Each line prints the
wall and CPU seconds (the children's included), the job's own `time:` line, the exported
capacity, and a hash of the export less its wall-clock fields. `--repeat N` alternates them N
times and prints the medians (this machine is shared: one run moves by 10%).

python bench/bench_study.py [scenario ...] [--old REV] [--seed N] [--repeat N] [--source]
    [--one-process]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testing.exports import without_wall_clock  # noqa: E402

BUDGET_S = 60.0


def _export_hash(path: Path) -> tuple[str, str]:
    if not path.exists():
        return "-", "none"
    exported = yaml.safe_load(path.read_text())
    summary = exported.get("capacity") or {}
    capacity, unit = summary.get("rate"), summary.get("rate_unit", "req/s")
    digest = hashlib.sha256(yaml.safe_dump(without_wall_clock(exported)).encode()).hexdigest()[:12]
    return f"{capacity:.4g} {unit}" if capacity else "-", digest


def _run(tree: Path, scenario: str, seed: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        command = [sys.executable, "-m", "tuner", "--scenario", scenario, "--seed", str(seed)]
        result = subprocess.run(
            [*command, "--no-html"],
            cwd=work,
            capture_output=True,
            text=True,
            env=os.environ | {"PYTHONPATH": str(tree)} | env,
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        capacity, digest = _export_hash(Path(work) / "best-config.yaml")
    timeline = [line for line in result.stderr.splitlines() if line.startswith("time:")]
    return {
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "status": {0: "ok", 3: "no feasible config"}.get(
            result.returncode, f"exit {result.returncode}"
        ),
        "time": timeline[-1] if timeline else "",
        "capacity": capacity,
        "hash": digest,
    }


def _extract(revision: str, into: Path) -> None:
    archive = into / "tree.tar"
    subprocess.run(["git", "archive", "-o", str(archive), revision], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*", default=["customer-service"])
    parser.add_argument("--old", default="65141e5", help="the revision to compare against")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--source", action="store_true", help="also the simulator's source")
    parser.add_argument("--one-process", action="store_true", help="also on one process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as old_dir:
        old = Path(old_dir)
        _extract(args.old, old)
        variants = [
            (f"old ({args.old})", old, {}),
            ("new", ROOT, {}),
        ]
        if args.source:
            variants.append(("new, source", ROOT, {"AUTOTUNE_PURE_PYTHON": "1"}))
        if args.one_process:
            variants.append(("new, 1 process", ROOT, {"AUTOTUNE_SIM_PROCESSES": "1"}))
        for scenario in args.scenarios:
            runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
            for _ in range(args.repeat):
                for name, tree, env in variants:
                    runs[name].append(_run(tree, scenario, args.seed, env))
            for name, _, _ in variants:
                wall = statistics.median(r["wall"] for r in runs[name])
                cpu = statistics.median(r["cpu"] for r in runs[name])
                last = runs[name][-1]
                print(
                    f"{scenario:20} {name:18} {wall:6.1f} s wall ({wall / BUDGET_S:.2f} of the "
                    f"minute), {cpu:6.1f} s CPU, {last['status']}; export {last['capacity']} "
                    f"#{last['hash']}; {last['time']}",
                    flush=True,
                )
            exports = {name: runs[name][-1]["hash"] for name, _, _ in variants}
            same = len(set(exports.values())) == 1
            print(f"{scenario:20} every variant exports the same: {same}", flush=True)


if __name__ == "__main__":
    main()
