"""What two runs of one study may differ in, and an export or a trial's attributes without it:
the tests and the benchmarks that compare runs (one process against two, old code against
new) compare what is left."""

from __future__ import annotations

from typing import Any

# When and where a run ran, and how long its search took.
WALL_CLOCK = ("exported_at", "created_at", "worker", "runner_search_s")


def without_wall_clock(value: Any) -> Any:
    """`value` (an export, a trial's attributes, a hold) with every WALL_CLOCK key dropped, at
    any depth."""
    if isinstance(value, dict):
        return {k: without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [without_wall_clock(v) for v in value]
    return value
