"""Each trial's quality figure, and the checks that make a quality SLO answerable before a study.

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
from pathlib import Path
from typing import Any

import optuna

from objectives.quality import (
    FIGURES,
    REFERENCE,
    ModelQuality,
    QualityFigure,
    describe_missing_model,
    find_shipped,
    load_table,
)
from objectives.scenario import QUALITY_SLO_FIELDS, Scenario
from objectives.scoring import quality_constraint_values
from objectives.userfile import InputError
from runners.base import FailedSession, Runner
from runners.quality import QualityUnavailable, is_reference, load_eval_prompts, quality_pair
from search_spaces.space import SearchSpace
from tuner.console import err

# What a runner's measure_quality returns: teacher-forced log-probabilities against the
# reference, so KL and top-1 agreement, never benchmark accuracy.
RUNNER_MEASURES = ("kl", "top1_agreement")
MEASURED = "quality_measured:"  # study user attribute per pair: a measured figure and its cost
UNAVAILABLE = (
    "quality_unavailable:"  # study user attribute per pair: why the runner could not measure it
)
REFERENCE_UNAVAILABLE = (
    "quality_reference_unavailable"  # study user attribute: why no reference could be measured
)
EXCLUDED = "quality_excluded"  # study user attribute: pairs the space dropped before the study, with their figures
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
    prepare: Callable[..., None] | None = (
        None  # the runner's prepare_quality: the reference, measured alone
    )
    log: Callable[[str], None] = field(
        default=lambda line: err.print(line, markup=False, highlight=False)
    )

    def table_only(self) -> QualityBook:
        """The same record and table, measuring nothing (the simulator's screen reads it)."""
        return QualityBook(
            self.study, None, self.table, model=self.model, runner=self.runner, log=self.log
        )

    def session_hook(self, config: dict[str, Any]) -> Callable[[Any], None] | None:
        """For runners.capacity.evaluate: measure the pair once its engine serves, unless the
        study already knows it (measured, or known not to be measurable)."""
        if self.measure is None:
            return None
        pair = quality_pair(config)

        def hook(session) -> None:
            if isinstance(session, FailedSession) or self._recorded(pair):
                return
            self._measure(config, session, pair)

        return hook

    def before_session(self, config: dict[str, Any]) -> None:
        """Measure the reference before the trial's engine starts, where the pair is still to be
        measured: measure_quality would otherwise start the reference beside the trial's engine,
        and two engines on one accelerator may not fit. A reference pair measures itself."""
        pair = quality_pair(config)
        if self.prepare is None or is_reference(config) or self._recorded(pair):
            return
        reason = self.study.user_attrs.get(REFERENCE_UNAVAILABLE)
        if reason is None:
            try:
                self.prepare(config, self.prompts)
                return
            except MEASUREMENT_ERRORS as error:
                reason = _reason(error)
                # Without a reference no pair can be measured: tried once per study, not per pair.
                self.study.set_user_attr(REFERENCE_UNAVAILABLE, reason)
        self.study.set_user_attr(UNAVAILABLE + pair_key(pair), reason)
        self.log(f"quality: {pair_key(pair)} not measured: {reason}")

    def _recorded(self, pair: tuple[str, float]) -> bool:
        attrs = self.study.user_attrs
        return MEASURED + pair_key(pair) in attrs or UNAVAILABLE + pair_key(pair) in attrs

    def _measure(self, config: dict[str, Any], session, pair: tuple[str, float]) -> None:
        key, started = pair_key(pair), time.monotonic()
        try:
            figure = self.measure(config, session, self.prompts)
        except (
            MEASUREMENT_ERRORS
        ) as error:  # a cache that cannot be written is no reason to lose the trial
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
        table = self.table.figure(pair) if self.table else None
        if table is not None:
            reason = attrs.get(UNAVAILABLE + pair_key(pair))
            where = f"{self.table.source}; not measured: {reason}" if reason else self.table.source
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
                "quality_note": f"no quality figure: {why}, and no quality table covers {self.model!r} "
                f"at {pair_key(quality_pair(config))} (give --quality FILE)"
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
        "kl": lambda v: f"KL {v:.3g}",
        "top1_agreement": lambda v: f"top-1 {v:.1%}",
    }
    return (
        ", ".join(short[k](v) for k, v in figures.items())
        + f" ({attrs.get('quality_source', '?')})"
    )


# -- before the study ------------------------------------------------------------------------


def searched(space: SearchSpace, name: str, default: Any) -> list[Any] | None:
    """The values a categorical-like knob may take in the space (None: a numeric range)."""
    spec = space.ranges.get(name)
    if spec is None:
        return [default]
    if spec.value is not None:
        return [spec.value]
    return list(spec.choices) if spec.choices is not None else None


@dataclass
class QualityPlan:
    table: AppliedTable | None
    prompts: list[str] | None
    space: SearchSpace
    excluded: list[dict[str, Any]] = field(default_factory=list)  # pairs dropped before the study

    def book(self, study: optuna.Study, runner: Runner) -> QualityBook:
        return _book(study, runner, self.table, self.prompts)


def _book(
    study: optuna.Study, runner: Runner, table: AppliedTable | None, prompts: list[str] | None
) -> QualityBook:
    identity = runner.identity()
    return QualityBook(
        study,
        getattr(runner, "measure_quality", None),
        table,
        prompts,
        identity["model"],
        identity["runner"],
        prepare=getattr(runner, "prepare_quality", None),
    )


def default_book(study: optuna.Study, runner: Runner) -> QualityBook:
    """For a study run made without a plan (tests, benches): the shipped table of the runner's
    model, and the shipped evaluation prompts for a runner that measures."""
    return _book(
        study, runner, _applied_table(None, runner.identity()["model"]), _prompts(runner, None)
    )


def _prompts(runner: Runner, path: Path | None) -> list[str] | None:
    return None if getattr(runner, "measure_quality", None) is None else load_eval_prompts(path)


def _applied_table(quality_path: Path | None, model: str) -> AppliedTable | None:
    if quality_path is not None:
        source = f"--quality {quality_path}"
        table = load_table(quality_path)
        found = table.for_model(model)
        if found is None:
            raise describe_missing_model(str(quality_path), table, model)
        return AppliedTable(source, *found)
    shipped = find_shipped(model)
    if shipped is None:
        return None
    source, table = shipped
    return AppliedTable(source, *table.for_model(model))


def _pairs(space: SearchSpace) -> list[tuple[str, float]]:
    precisions = searched(space, "quantization", REFERENCE[0]) or []
    kvs = searched(space, "kv_compression", REFERENCE[1]) or []
    return [(q, float(kv)) for q in precisions for kv in kvs]


def _check_coverage(table: AppliedTable, space: SearchSpace) -> None:
    """Every pair the space searches must have a figure in a table that applies."""
    for pair in _pairs(space):
        missing = table.model.missing(*pair)
        if missing:
            path = table.source.removeprefix("--quality ")
            raise InputError(
                f"{path}: models[{table.index}] ({table.model.names[0]}): {missing}, which the "
                f"search space searches; add an entry with its source and note"
            )


def _check_answerable(
    scenario: Scenario, source: str, runner: Runner, table: AppliedTable | None, space: SearchSpace
) -> None:
    """Each figure the SLO bounds must come from the runner or, for every searched pair, the table."""
    measures = getattr(runner, "measure_quality", None) is not None
    name, model = runner.identity()["runner"], runner.identity()["model"]
    for figure in scenario.quality.bounds() if scenario.quality else {}:
        if measures and figure in RUNNER_MEASURES:
            continue
        lacking = [
            pair
            for pair in _pairs(space)
            if table is None or getattr(table.figure(pair), figure, None) is None
        ]
        if not lacking:
            continue
        where = (
            f"no quality table covers the model {model!r}"
            if table is None
            else f"{table.source} gives no {figure} for {pair_key(lacking[0])}"
        )
        runner_part = (
            f"the {name} runner measures only KL and top-1 agreement"
            if measures
            else f"the {name} runner measures no quality"
        )
        raise InputError(
            f"{source}: quality.{QUALITY_SLO_FIELDS[figure]}: {runner_part} and {where}; supply the "
            f"figure with --quality FILE (a table of {figure} per precision"
            + (
                ")"
                if measures
                else ") or use a runner that measures it (--runner vllm or llamacpp)"
            )
        )


def _narrow(
    scenario: Scenario, source: str, table: AppliedTable, space: SearchSpace
) -> tuple[SearchSpace, list]:
    """Drop the precisions whose every KV setting misses the SLO by the table: no trial wasted on them."""
    pairs = _pairs(space)  # every one has a figure: _check_coverage saw to it
    figures = {pair: table.figure(pair) for pair in pairs}
    excess = {
        pair: quality_constraint_values(figure.values(), scenario.quality)
        for pair, figure in figures.items()
    }
    misses = {pair for pair, values in excess.items() if any(v > 0 for v in values.values())}
    precisions = list(dict.fromkeys(q for q, _ in pairs))
    dropped = [q for q in precisions if all(pair in misses for pair in pairs if pair[0] == q)]
    if not dropped:
        return space, []
    shown = {pair: describe_figures(merged_attrs([figures[pair]])) for pair in pairs}
    if len(dropped) == len(precisions):
        raise InputError(
            f"{source}: quality: no precision searched meets it by {table.source} ("
            + "; ".join(f"{pair_key(p)}: {shown[p]}" for p in pairs)
            + "); relax it or search other precisions"
        )
    best_of = {
        q: min(
            (pair for pair in pairs if pair[0] == q), key=lambda pair: sum(excess[pair].values())
        )
        for q in dropped
    }
    reasons = ", ".join(f"{q} ({shown[best_of[q]]} at best)" for q in dropped)
    narrowed = space.restrict(
        "quantization",
        [q for q in precisions if q not in dropped],
        f"the quality SLO of {source} rules out {reasons}, by {table.source}",
    )
    excluded = [
        {"quantization": q, "kv_compression": kv, **merged_attrs([figures[(q, kv)]])}
        for q, kv in pairs
        if q in dropped
    ]
    return narrowed, excluded


def plan_quality(
    scenario: Scenario,
    source: str,
    runner: Runner,
    space: SearchSpace,
    quality_path: Path | None,
    prompts_path: Path | None,
) -> QualityPlan:
    """Read the quality inputs, check that the SLO can be answered, narrow the space where the
    table alone decides (a runner that measures nothing). Raises InputError before any storage."""
    measures = getattr(runner, "measure_quality", None) is not None
    identity = runner.identity()
    if prompts_path is not None and not measures:
        raise InputError(
            f"--quality-prompts: the {identity['runner']} runner measures no quality (it reads the "
            "quality table); give it with --runner vllm or llamacpp"
        )
    prompts = _prompts(runner, prompts_path)
    table = _applied_table(quality_path, identity["model"])
    if table is not None:
        _check_coverage(table, space)
    _check_answerable(scenario, source, runner, table, space)
    excluded: list[dict[str, Any]] = []
    if table is not None and not measures and scenario.quality is not None:
        space, excluded = _narrow(scenario, source, table, space)
    return QualityPlan(table, prompts, space, excluded)
