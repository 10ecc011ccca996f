"""Each trial's quality figure, from the best source that has it (tuner.quality_plan checks
before the study that a quality SLO can be answered).

Quality depends only on the (quantization, kv_compression) pair, so a runner that measures it
(`measure_quality`, inside the trial's engine session) does so once per pair and study: the
figure is kept in the study's user attributes, where every worker and every resumed run finds
it. A pair the runner cannot measure (QualityUnavailable) is not tried again; its figure comes
from the quality table, the reason in its note. The simulator measures nothing: the table it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna

from objectives.quality import FIGURES, ModelQuality, QualityFigure
from runners.base import FailedSession
from runners.quality import QualityUnavailable, is_reference, quality_pair
from tuner.console import err

# The study's user attributes:
MEASURED = "quality_measured:"  # per pair: a measured figure and its cost
UNAVAILABLE = "quality_unavailable:"  # per pair: why the runner could not measure it
REFERENCE_UNAVAILABLE = "quality_reference_unavailable"  # why no reference could be measured
REFERENCE_FAILURES = "quality_reference_failures"  # failed starts of the reference so far
# Starts of the reference tried, in as many trials, before the study measures no pair: one
# failure may be another worker's engine holding the memory.
REFERENCE_TRIES = 3
# A claimed pair whose figure is not recorded after this long was claimed by a worker that
# died: a later trial takes the claim over (a measurement takes seconds to a few minutes).
CLAIM_STALE_S = 900
CLAIM_POLL_S = 0.5
EXCLUDED = "quality_excluded"  # pairs the space dropped before the study, with their figures
FIGURE_NAMES = {"accuracy_drop": "accuracy drop", "kl": "KL", "top1_agreement": "top-1 agreement"}


def pair_key(pair: tuple[str, float]) -> str:
    return f"{pair[0]}@{pair[1]:g}"


@dataclass
class AppliedTable:
    """The quality table entry of the study's model, and where it was read."""

    source: str  # "--quality FILE" or the shipped table's name, for messages and notes
    index: int  # the model's position in the table's `models`
    model: ModelQuality

    def figure(self, pair: tuple[str, float]) -> QualityFigure | None:
        return self.model.figure(*pair)


MEASUREMENT_ERRORS = (QualityUnavailable, OSError, ValueError, KeyError)


def _reason(error: Exception) -> str:
    return (
        error.reason
        if isinstance(error, QualityUnavailable)
        else f"{type(error).__name__}: {error}"
    )


@dataclass
class QualityBook:
    """Where a trial's quality comes from: the study's record, the runner, or the table."""

    study: optuna.Study
    measure: Callable[..., QualityFigure] | None  # the runner's measure_quality, if it has one
    table: AppliedTable | None
    prompts: list[str] | None = None
    model: str = ""
    runner: str = ""
    measurements: int = 0  # figures this process measured (each pair at most once per study)
    measure_s: float = 0.0  # what measuring them cost, in seconds
    # the runner's prepare_quality: the reference, measured alone
    prepare: Callable[..., None] | None = None
    # claims a pair's measurement for this worker (tuner.storage.claim_pair; False: another
    # worker measures it, wait for its figure); None: this process is the study's only writer
    claim: Callable[[str], bool] | None = None
    release: Callable[[str], None] | None = None  # gives back a claim that got no figure
    # the pair this trial leaves unmeasured (its reference failed to start; tried again later)
    unmeasured_now: tuple[str, float] | None = None
    log: Callable[[str], None] = field(
        default=lambda line: err.print(line, markup=False, highlight=False)
    )

    def table_only(self) -> QualityBook:
        """The same record and table, measuring nothing (the simulator's screen reads it)."""
        return QualityBook(
            self.study, None, self.table, model=self.model, runner=self.runner, log=self.log
        )

    def session_hook(self, config: dict[str, Any]) -> Callable[[Any], None] | None:
        """For runners.load.capacity.evaluate: measure the pair once its engine serves, unless the
        study already knows it (measured, or known not to be measurable)."""
        if self.measure is None:
            return None
        pair = quality_pair(config)

        def hook(session) -> None:
            if isinstance(session, FailedSession) or self._recorded(pair):
                return
            if self.unmeasured_now == pair:  # its reference failed before this trial's start
                return
            if self.claim is not None and not self.claim(pair_key(pair)):
                self._await(pair)
                return
            try:
                self._measure(config, session, pair)
            finally:
                if self.release is not None and not self._recorded(pair):
                    self.release(pair_key(pair))

        return hook

    def before_session(self, config: dict[str, Any]) -> None:
        """Measure the reference before the trial's engine starts, where the pair is still to be
        measured: measure_quality would otherwise start the reference beside the trial's engine,
        and two engines on one accelerator may not fit. A reference pair measures itself.
        A failed start (another worker's engine holding the memory) is retried in later trials;
        after REFERENCE_TRIES failures the study measures no pair."""
        pair = quality_pair(config)
        self.unmeasured_now = None
        if self.prepare is None or is_reference(config) or self._recorded(pair):
            return
        reason = self.study.user_attrs.get(REFERENCE_UNAVAILABLE)
        if reason is None:
            try:
                self.prepare(config, self.prompts)
                return
            except MEASUREMENT_ERRORS as error:
                reason = _reason(error)
                tries = self.study.user_attrs.get(REFERENCE_FAILURES, 0) + 1
                self.study.set_user_attr(REFERENCE_FAILURES, tries)
                if tries < REFERENCE_TRIES:
                    self.unmeasured_now = pair  # this trial only: a later one tries again
                    self.log(
                        f"quality: {pair_key(pair)} not measured in this trial: the reference "
                        f"failed ({reason}); {tries} of {REFERENCE_TRIES} tries"
                    )
                    return
                self.study.set_user_attr(REFERENCE_UNAVAILABLE, reason)
        self.study.set_user_attr(UNAVAILABLE + pair_key(pair), reason)
        self.log(f"quality: {pair_key(pair)} not measured: {reason}")

    def _await(self, pair: tuple[str, float]) -> None:
        """Another worker measures the pair: wait for its figure (or its reason), so this trial
        carries the same one; a claim it never fulfils is taken over by a later trial."""
        key = pair_key(pair)
        self.log(f"quality: {key} is being measured by another worker; waiting for its figure")
        deadline = time.monotonic() + CLAIM_STALE_S
        while not self._recorded(pair):
            if time.monotonic() > deadline:
                self.log(f"quality: {key}: no figure from the other worker in {CLAIM_STALE_S} s")
                return
            time.sleep(CLAIM_POLL_S)

    def _recorded(self, pair: tuple[str, float]) -> bool:
        attrs = self.study.user_attrs
        return MEASURED + pair_key(pair) in attrs or UNAVAILABLE + pair_key(pair) in attrs

    def _measure(self, config: dict[str, Any], session, pair: tuple[str, float]) -> None:
        assert self.measure is not None, "session_hook makes no hook without measure"
        key, started = pair_key(pair), time.monotonic()
        try:
            figure = self.measure(config, session, self.prompts)
        # A cache that cannot be written is no reason to lose the trial.
        except MEASUREMENT_ERRORS as error:
            self.study.set_user_attr(UNAVAILABLE + key, _reason(error))
            self.log(f"quality: {key} not measured: {_reason(error)}")
            return
        seconds = time.monotonic() - started
        self.measurements += 1
        self.measure_s += seconds
        self.study.set_user_attr(
            MEASURED + key, {"figure": figure.model_dump(mode="json"), "seconds": seconds}
        )
        shown = ", ".join(f"{FIGURE_NAMES[k]} {v:.4g}" for k, v in figure.values().items())
        self.log(f"quality: measured {key}: {shown} ({figure.samples} positions, {seconds:.1f} s)")

    def figures(self, config: dict[str, Any]) -> list[QualityFigure]:
        """The pair's figures, the best first: measured in this study, then the table's."""
        pair, attrs = quality_pair(config), self.study.user_attrs
        found = []
        if MEASURED + pair_key(pair) in attrs:
            found.append(QualityFigure.model_validate(attrs[MEASURED + pair_key(pair)]["figure"]))
        applied = self.table
        table = applied.figure(pair) if applied is not None else None
        if applied is not None and table is not None:
            reason = attrs.get(UNAVAILABLE + pair_key(pair))
            where = f"{applied.source}; not measured: {reason}" if reason else applied.source
            found.append(table.model_copy(update={"note": f"{table.note} ({where})"}))
        return found

    def trial_attrs(self, config: dict[str, Any]) -> dict[str, Any]:
        """The trial's quality_* user attributes: each figure from the best source that has it."""
        figures = self.figures(config)
        if not figures:
            reason = self.study.user_attrs.get(UNAVAILABLE + pair_key(quality_pair(config)))
            why = (
                f"not measured: {reason}"
                if reason
                else "not measured"
                if self.measure
                else f"the {self.runner} runner measures none"
            )
            return {
                "quality_note": f"no quality figure: {why}, and no quality table covers "
                f"{self.model!r} at {pair_key(quality_pair(config))} (give --quality FILE)"
            }
        return merged_attrs(figures)


def merged_attrs(figures: list[QualityFigure]) -> dict[str, Any]:
    """quality_* attributes from figures, the best first: each figure from the first that has it."""
    attrs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    used: list[QualityFigure] = []
    for name in FIGURES:
        having = next((f for f in figures if getattr(f, name) is not None), None)
        if having is not None:
            attrs[f"quality_{name}"] = getattr(having, name)
            sources[name] = having.source
            used += [having] if not any(having is f for f in used) else []
    attrs["quality_source"] = " + ".join(dict.fromkeys(f.source for f in used))
    if len(set(sources.values())) > 1:
        attrs["quality_sources"] = sources
    attrs["quality_note"] = "; ".join(f.note for f in used)
    samples = next((f.samples for f in used if f.samples is not None), None)
    if samples is not None:
        attrs["quality_samples"] = samples
    return attrs


def trial_figures(attrs: dict[str, Any]) -> dict[str, float | None]:
    """A trial's quality figures from its user attributes (None: not known)."""
    return {name: attrs.get(f"quality_{name}") for name in FIGURES}


def quality_summary(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """A trial's quality as the export and `pareto --json` give it: figures, source, note."""
    keys = [*FIGURES, "source", "sources", "note", "samples"]
    summary = {
        key: attrs[f"quality_{key}"] for key in keys if attrs.get(f"quality_{key}") is not None
    }
    return summary or None


def describe_figures(attrs: dict[str, Any]) -> str:
    """`drop 0.7 (published)`: a trial's figures for a table cell, or `-`."""
    figures = {k: v for k, v in trial_figures(attrs).items() if v is not None}
    if not figures:
        return "-"

    def points(v: float) -> str:  # 1.0, 0.7, 0.07: as many decimals as the figure has, up to two
        return f"{v:.1f}" if round(v, 1) == round(v, 2) else f"{v:.2f}"

    short = {
        "accuracy_drop": lambda v: f"drop {points(v)}",
        # KL is never below 0: a measured -0.0 or -1e-12 is rounding (bf16 against itself)
        "kl": lambda v: f"KL {max(0.0, v):.3g}",  # max keeps its first of equals
        "top1_agreement": lambda v: f"top-1 {v:.1%}",
    }
    return (
        ", ".join(short[k](v) for k, v in figures.items())
        + f" ({attrs.get('quality_source', '?')})"
    )
