"""Before a study: the quality inputs read (the table, the evaluation prompts), the quality SLO
checked answerable for every pair the space searches, and the space narrowed where the table
alone rules a precision out. Every check raises InputError before any storage is touched."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from objectives.quality import (
    REFERENCE,
    QualityFigure,
    describe_missing_model,
    find_shipped,
    load_table,
)
from objectives.scenario import QUALITY_SLO_FIELDS, Scenario
from objectives.scoring import quality_constraint_values
from objectives.userfile import InputError
from runners.base import Runner
from runners.quality import load_eval_prompts
from search_spaces.space import SearchSpace
from tuner.quality import AppliedTable, QualityBook, describe_figures, merged_attrs, pair_key

# What a runner's measure_quality returns: teacher-forced log-probabilities against the
# reference, so KL and top-1 agreement, never benchmark accuracy.
RUNNER_MEASURES = ("kl", "top1_agreement")


def searched(space: SearchSpace, name: str, default: Any) -> list[Any] | None:
    """The values a categorical-like knob may take in the space (None: a numeric range)."""
    spec = space.ranges.get(name)
    return [default] if spec is None else spec.listed()


@dataclass
class QualityPlan:
    table: AppliedTable | None
    prompts: list[str] | None
    space: SearchSpace
    # the pairs dropped before the study, with their figures
    excluded: list[dict[str, Any]] = field(default_factory=list)

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
    found = table.for_model(model)
    assert found is not None, "find_shipped gives only a table that names the model"
    return AppliedTable(source, *found)


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
    """Each figure the SLO bounds must come from the runner or, for every searched pair, the
    table."""
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
            f"{source}: quality.{QUALITY_SLO_FIELDS[figure]}: {runner_part} and {where}; "
            f"supply the figure with --quality FILE (a table of {figure} per precision"
            + (
                ")"
                if measures
                else ") or use a runner that measures it (--runner vllm or llamacpp)"
            )
        )


def _narrow(
    scenario: Scenario, source: str, table: AppliedTable, space: SearchSpace
) -> tuple[SearchSpace, list[dict[str, Any]]]:
    """Drop the precisions whose every KV setting misses the SLO by the table: no trial wasted
    on them."""
    pairs = _pairs(space)
    figures: dict[tuple[str, float], QualityFigure] = {}
    for pair in pairs:
        figure = table.figure(pair)
        assert figure is not None, "_check_coverage saw to it that every pair has a figure"
        figures[pair] = figure
    excess = {
        pair: quality_constraint_values(dict(figure.values()), scenario.quality)
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
