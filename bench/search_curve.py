"""The tuning-efficiency curve of bench/bench_search.py: the median share of the grid's best
SLA-feasible capacity a sampler has found, against trials and against seconds.

Per (scenario, seed): after n trials, the best SLA-feasible capacity among them over the grid's
best (0 while none is feasible); the curve is the median over the pairs of a group (the presets,
the random scenarios). Seconds are what the trials would cost on one core: each grid point's
own evaluation time, measured when the grid was (bench/search_truth.py), plus the sampler's own
time for that trial (its ask and tell), summed in trial order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from objectives.scoring import is_feasible

TRIAL_MARKS = (5, 10, 15, 25, 50)
SECOND_MARKS = (0.5, 1, 2, 4, 8)


def reached(outcomes: list, best: float) -> np.ndarray:
    """Share of `best` found after each trial."""
    found, out = 0.0, []
    for r in outcomes:
        if r and is_feasible(r[2]):
            found = max(found, r[1] / best)
        out.append(found)
    return np.array(out)


def elapsed(outcomes: list, sampler_s: list[float]) -> np.ndarray:
    """Seconds after each trial: its evaluation (r[3], 0 where it could not run) and the
    sampler's time."""
    pairs = zip(outcomes, sampler_s, strict=True)
    return np.cumsum([(r[3] if r and len(r) > 3 else 0.0) + s for r, s in pairs])


def at_seconds(shares: np.ndarray, seconds: np.ndarray, t: float) -> float:
    """Share found by the trials finished within `t` seconds."""
    done = np.searchsorted(seconds, t, side="right")
    return float(shares[done - 1]) if done else 0.0


class Curves:
    """Every (scenario, seed) run of one sampler in one group."""

    def __init__(self) -> None:
        self.shares: list[np.ndarray] = []
        self.seconds: list[np.ndarray] = []

    def add(self, outcomes: list, sampler_s: list[float], best: float) -> None:
        self.shares.append(reached(outcomes, best))
        self.seconds.append(elapsed(outcomes, sampler_s))

    def by_trials(self, n: int) -> float:
        return float(np.median([s[min(n, s.size) - 1] for s in self.shares]))

    def by_seconds(self, t: float) -> float:
        pairs = zip(self.shares, self.seconds, strict=True)
        return float(np.median([at_seconds(s, c, t) for s, c in pairs]))

    def cells(self) -> list[str]:
        trials = [f"{self.by_trials(n):.0%}" for n in TRIAL_MARKS]
        seconds = [f"{self.by_seconds(t):.0%}" for t in SECOND_MARKS]
        return [str(len(self.shares)), *trials, *seconds]


HEADER = (
    ["group", "sampler", "pairs"]
    + [f"@{n} trials" for n in TRIAL_MARKS]
    + [f"@{t} s" for t in SECOND_MARKS]
)


def table(curves: dict[tuple[str, str], Curves]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|---|---|" + "---:|" * (len(HEADER) - 2)]
    for (group, sampler), c in curves.items():
        lines.append("| " + " | ".join([group, sampler, *c.cells()]) + " |")
    return "\n".join(lines)


def plot(curves: dict[tuple[str, str], Curves], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_trials, by_seconds) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {}
    for (group, sampler), c in curves.items():
        horizon = min(s.size for s in c.shares)
        trials = np.arange(1, horizon + 1)
        line = styles.setdefault(group, "-" if not styles else "--")
        (drawn,) = by_trials.plot(
            trials, [c.by_trials(n) for n in trials], line, label=f"{sampler}, {group}"
        )
        shortest = min(float(s[0]) for s in c.seconds if s.size)
        longest = max(float(s[-1]) for s in c.seconds)
        ts = np.geomspace(max(shortest, 1e-3), longest, 200)
        by_seconds.plot(ts, [c.by_seconds(t) for t in ts], line, color=drawn.get_color())
    for axis, label in ((by_trials, "trials"), (by_seconds, "seconds on one core")):
        axis.set_xlabel(label)
        axis.set_ylim(0, 1.02)
        axis.axhline(0.95, color="grey", lw=0.8, ls=":")
        axis.grid(alpha=0.3)
    by_seconds.set_xscale("log")
    by_trials.set_ylabel("median share of the grid's best capacity")
    by_trials.axvline(25, color="grey", lw=0.8, ls=":")
    by_trials.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
