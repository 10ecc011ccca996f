"""What the load generator adds to TTFT (issue 30, item 8): its TTFT against a stand-in server
whose first chunk leaves 20 ms after the request arrived (testing/timed_stand_in.py, its own
process), less that wait, per request; over a few runs of a hundred requests.

    python bench/bench_loadgen.py [--runs 3] [--requests 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testing.timed_stand_in import overhead_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, choices=range(1, 101), metavar="N")
    parser.add_argument("--requests", type=int, default=100, choices=range(10, 10_001), metavar="N")
    args = parser.parse_args()
    print("run  median ms  p90 ms  min ms")
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            added = sorted(overhead_ms(Path(folder), args.requests))
        p90 = added[int(0.9 * (len(added) - 1))]
        print(f"{run:>3}  {statistics.median(added):>9.3f}  {p90:>6.3f}  {added[0]:>6.3f}")


if __name__ == "__main__":
    main()
