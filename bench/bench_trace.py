"""A trace's replay (issue 43): the azure-conversation export held over the whole trace and
beyond, the simulator's cost per request on a trace against a parametric workload, and the
memory a trace's reader takes.

    python bench/bench_trace.py [--export EXPORT] [--workdir DIR] [--big-mb 256]

1. The export (without --export: the preset's main job, `autotune --scenario
   azure-conversation`) held at the rate it states under fixed loads: the whole hour as
   recorded, four hours (the hour replayed 4 times end to end), and the hour started at two
   other points (fresh draws: the same traffic, its busy minutes met elsewhere in the load),
   each judged on the whole SLA.
2. Simulated requests per CPU second: the trace's replay against customer-service's drawn
   requests, on one config, at about the same load.
3. Reading a trace streams: a Mooncake-format file of --big-mb MB, a 1,000-request window and
   the whole file read in a child process each, its peak memory (ru_maxrss) and seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from objectives.scenario import SLA, load_scenario
from objectives.scoring import constraint_values, is_feasible
from runners.load.measurement import summarize
from runners.sim.runner import DEFAULTS, SimRunner
from tuner.export import load_export

PRESET = "azure-conversation"
# (label, replays of the window, draw): the tuner's hold draws 0 to 11; 100 and 101 are none
LOADS = (
    ("the hour", 1, 0),
    ("4 hours", 4, 0),
    ("hour, draw 100", 1, 100),
    ("hour, draw 101", 1, 101),
)


def hold_export(export_path: Path) -> bool:
    exported = load_export(export_path)
    scenario = load_scenario(exported.scenario)
    scenario = scenario.model_copy(update={"sla": SLA.model_validate(exported.sla)})
    capacity = exported.capacity or {}
    rate = capacity["rate"]
    print(
        f"export: {export_path} trial {exported.trial}: {rate:.4g} req/s "
        f"({capacity.get('trace_multiple', float('nan')):.3g}x the trace), knobs {exported.knobs}"
    )
    print(f"{'load':<16} {'requests':>9} {'TTFT p99 ms':>12} {'TPOT p99 ms':>12} "
          f"{'delivered':>9} {'SLA':>4}")  # fmt: skip
    runner, every = SimRunner(), True
    for label, replays, draw in LOADS:
        load = scenario.at_rate(rate, draw)
        load = load.model_copy(update={"num_requests": load.num_requests * replays})
        with runner.session(DEFAULTS | exported.knobs, load) as session:
            m = summarize(session.measure(load, scenario.sla, False), scenario.sla)
        meets = is_feasible(constraint_values(m, scenario.sla))
        every &= meets
        print(
            f"{label:<16} {load.num_requests:>9} {m['ttft_p99_ms']:>12.0f} "
            f"{m['tpot_p99_ms']:>12.1f} {m['delivered_share']:>9.1%} {'yes' if meets else 'NO':>4}"
        )
    print(f"the export meets its SLA under every load: {'yes' if every else 'NO'}")
    return every


def cost_per_request() -> None:
    """One config on the trace's replay and on drawn requests alike in rate and lengths
    (Poisson at its rate, lognormal lengths with its medians and spreads), as many of each:
    simulated requests per CPU second, the trace's read and keys included (warm: cached)."""
    from objectives.scenario import Workload
    from objectives.trace_fit import lognormal_fit
    from objectives.trace_formats import read_window

    runner = SimRunner()
    config = DEFAULTS | dict(
        batch_size=128, select_batch="decode-first", quantization="w8a8", max_prefill_tokens=16384
    )
    trace = load_scenario(PRESET).workload
    window = read_window(trace.trace)
    drawn = Workload.model_validate(
        {
            "arrival": {"kind": "poisson", "rate": window.rate},
            "num_requests": len(window),
            "input_tokens": lognormal_fit(window.input_tokens)[0],
            "output_tokens": lognormal_fit(window.output_tokens)[0],
        }
    )
    print(f"{'workload':<26} {'requests':>9} {'CPU s':>7} {'req/CPU-s':>10} {'steps':>8}")
    for name, workload in (("azure trace, replayed", trace), ("drawn alike (Poisson)", drawn)):
        with runner.session(config, workload) as session:
            session.measure(workload)  # warm: the trace read, the imports
            started = time.process_time()
            for _ in range(5):
                m = session.measure(workload)
            cpu = (time.process_time() - started) / 5
        steps = int(m.extra.get("steps", 0))
        print(f"{name:<26} {len(m.ok):>9} {cpu:>7.3f} {len(m.ok) / cpu:>10.0f} {steps:>8}")


READER = """
import resource, sys, time
sys.path.insert(0, sys.argv[1])
from objectives.trace import Trace
from objectives.trace_formats import read_window
started = time.perf_counter()
trace = {"file": sys.argv[2], "format": "mooncake"}
if sys.argv[3] != "all":
    trace["requests"] = int(sys.argv[3])
window = read_window(Trace.model_validate(trace))
peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(window), time.perf_counter() - started, peak_kb)
"""


def reader_memory(megabytes: int) -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        written, t, next_id = 0, 0, 0
        with path.open("w") as out:
            while written < megabytes * 1_000_000:
                blocks = int(rng.integers(1, 60))
                ids = list(range(next_id, next_id + blocks))
                next_id += blocks
                t += int(rng.exponential(250))
                line = json.dumps(
                    {"timestamp": t, "input_length": blocks * 512, "output_length": 100,
                     "hash_ids": ids}
                ) + "\n"  # fmt: skip
                written += out.write(line)
        root = str(Path(__file__).resolve().parents[1])
        print(f"{'read':<14} {'file MB':>8} {'requests':>9} {'seconds':>8} {'peak RSS MB':>12}")
        for window in ("1000", "all"):
            out = subprocess.run(
                [sys.executable, "-c", READER, root, str(path), window],
                check=True, capture_output=True, text=True,
            ).stdout.split()  # fmt: skip
            count, seconds, peak_kb = int(out[0]), float(out[1]), int(out[2])
            label = "1,000 requests" if window != "all" else "the whole file"
            print(f"{label:<14} {written / 1e6:>8.0f} {count:>9} {seconds:>8.1f} "
                  f"{peak_kb / 1024:>12.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, default=None, help="an azure-conversation export")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the main job's files")
    parser.add_argument("--big-mb", type=int, default=256, help="the reader's file, MB (0: skip)")
    args = parser.parse_args()
    export = args.export
    with tempfile.TemporaryDirectory() as tmp:
        if export is None:
            work = args.workdir or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            export = work / "azure-conversation.yaml"
            started = time.perf_counter()
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
            subprocess.run(
                [sys.executable, "-m", "tuner", "--scenario", PRESET, "--no-html",
                 "--export", str(export), "--storage", f"sqlite:///{work / 'studies.db'}"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu
            print(f"main job: {time.perf_counter() - started:.0f} s wall, {cpu:.0f} s CPU")
        hold_export(export)
    cost_per_request()
    if args.big_mb:
        reader_memory(args.big_mb)


if __name__ == "__main__":
    main()
