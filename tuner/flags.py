"""Flag types that refuse, in one line naming the flag, values the code behind them cannot take
(click's own ranges let NaN through and have no upper bound)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

# Trials, repeats, candidates: a million is beyond any study, and far inside the database's
# 64-bit integer columns (an unbounded count overflowed them after the study was written).
MAX_COUNT = 1_000_000
# Beats between a running trial's heartbeats: an hour lets a dead worker's trial be failed as
# stale after three (threading waits overflow near 10^10 s and kill the heartbeat thread).
MAX_HEARTBEAT_S = 3600


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


COUNT = click.IntRange(1, MAX_COUNT)
SEED = click.IntRange(0, 2**32 - 1)  # numpy's seed range, which every Optuna sampler uses
SECONDS = FiniteRange(min=0, min_open=True)
HEARTBEAT_SECONDS = click.IntRange(1, MAX_HEARTBEAT_S)
PRICE = FiniteRange(min=0, min_open=True, max=1e9)  # per chip-hour, any currency
POLISH = click.IntRange(0, MAX_COUNT)


class OutputFile(click.Path):
    """A file to write: a value ending in a path separator names a directory, which Path would
    silently read as a file of that name."""

    def __init__(self):
        super().__init__(path_type=Path)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.endswith(("/", os.sep)):
            self.fail(f"{value!r} names a directory; give a file path in it", param, ctx)
        return super().convert(value, param, ctx)


OUTPUT_FILE = OutputFile()
