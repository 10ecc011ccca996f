"""A run's `--trials`: every trial it measures, split before it starts between the study's
own trials, the arms and polish after them (tuner.polish), and the pick's repeats (tuner.repeats:
measurements of configs already tried, counted as trials since each costs one). The hold states
its own cost (tuner.hold: it certifies the answer rather than searching for one), as does the
one-chip study a chip budget may run first (tuner.one_chip: a study of its own, kept for later
runs).

The defaults keep the answers of the runs before the budget: 50 study trials and 100 of arms and
polish on the simulator; on a real engine 50, 12, and 3 measurements of the pick and of each of up
to 3 rivals (the trial itself the first: 8 more). A `--trials` other than the default keeps the
default's shares."""

from __future__ import annotations

from dataclasses import dataclass

from objectives.userfile import InputError
from tuner.polish import REAL_POLISH_TRIALS, SIM_POLISH_TRIALS
from tuner.repeats import MAX_RIVALS, REAL_REPEATS

STUDY_TRIALS = 50  # the study's share of the default budget, on every runner


@dataclass(frozen=True)
class Budget:
    total: int
    study: int
    polish: int  # arms and polish
    repeats: int  # measurements of each candidate in all (0 or 1: none)
    repeat_trials: int  # what the repeats may spend: the candidates' measurements past the first

    def describe(self) -> str:
        parts = [f"{self.study} study trials", f"{self.polish} for the arms and polish"]
        if self.repeat_trials:
            parts.append(
                f"{self.repeat_trials} for repeats (the pick and up to {MAX_RIVALS} rivals, "
                f"{self.repeats} measurements each)"
            )
        return (
            f"budget: --trials {self.total}: " + ", ".join(parts) + "; the hold's cost is its own"
        )


def default_total(simulated: bool) -> int:
    polish = SIM_POLISH_TRIALS if simulated else REAL_POLISH_TRIALS
    return STUDY_TRIALS + polish + repeat_trials(0 if simulated else REAL_REPEATS)


def repeat_trials(repeats: int) -> int:
    """What `repeats` measurements of each candidate spend beyond its trial."""
    return (repeats - 1) * (1 + MAX_RIVALS) if repeats > 1 else 0


def split(
    total: int | None,
    polish: int | None,
    repeats: int | None,
    simulated: bool,
    grid: bool = False,
) -> Budget:
    """The run's budget: `total` (None: the runner's default) less the repeats' share, then
    `polish` (None: the default's share of what is left; none after a grid, which measures its
    points itself) for the arms and polish, the rest for the study. InputError naming --trials
    where nothing is left for the study."""
    default_polish = SIM_POLISH_TRIALS if simulated else REAL_POLISH_TRIALS
    if grid:  # nothing runs after a grid (tuner.polish): a --polish would be spent on nothing
        polish = 0
    named = "--trials" if total is not None else "the default --trials"
    total = default_total(simulated) if total is None else total
    if repeats is None:
        # the default's repeats where the study keeps as many trials as they spend (its pick
        # and rivals to repeat); a smaller budget runs unrepeated
        repeats = 0 if simulated else REAL_REPEATS
        if total - 2 * repeat_trials(repeats) - (polish or 0) < 0:
            repeats = 0
    spent_repeating = repeat_trials(repeats)
    left = total - spent_repeating
    if polish is None:
        polish = max(0, round(left * default_polish / (STUDY_TRIALS + default_polish)))
        if left - polish < 1:  # a budget of one or two: the study's first
            polish = max(0, left - 1)
    study = left - polish
    if study < 1:
        spent, flags = [], []
        if polish:
            spent.append(f"--polish {polish}")
            flags.append("--polish")
        if spent_repeating:
            spent.append(f"--repeats {repeats} ({spent_repeating} trials)")
            flags.append("--repeats")
        raise InputError(
            f"{named} {total} leaves no trial for the study after {' and '.join(spent)}: give "
            f"--trials at least {total - study + 1}, or a lower {' or '.join(flags)}"
        )
    return Budget(total, study, polish, repeats, spent_repeating)
