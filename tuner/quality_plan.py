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
from tuner.quality import (
    CLAIM_STALE_S,
    AppliedTable,
    QualityBook,
    describe_figures,
    merged_attrs,
    pair_key,
)
from tuner.storage import claim_pair, release_pair

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
    scenario: Scenario  # with the quality SLO this run applies
    notes: list[str]  # which forms of the SLO apply, and why the others do not
    # the pairs dropped before the study, with their figures
    excluded: list[dict[str, Any]] = field(default_factory=list)

    def assumptions(self) -> dict[str, Any]:
        """The table's figures of the pairs the space searches (tuner.assumptions): a stricter
        or corrected table would store other figures beside the study's."""
        if self.table is None:
            return {}
        dropped = [(e["quantization"], float(e["kv_compression"])) for e in self.excluded]
        figures = {}
        for pair in [*_pairs(self.space), *dropped]:  # a pair the SLO drops was searched before
            figure = self.table.figure(pair)
            shown = None if figure is None else figure.model_dump(mode="json", exclude={"note"})
            figures[f"{pair[0]} kv {pair[1]:g}"] = shown
        return {"quality table": figures}

    def book(
        self,
        study: optuna.Study,
        runner: Runner,
        storage: optuna.storages.RDBStorage | None = None,
    ) -> QualityBook:
        """The study's book; with its storage, workers sharing the study claim each pair."""
        book = _book(study, runner, self.table, self.prompts)
        if storage is not None:
            name = study.study_name
            book.claim = lambda pair: claim_pair(storage, name, pair, CLAIM_STALE_S)
            book.release = lambda pair: release_pair(storage, name, pair)
        return book


def _book(
    study: optuna.Study, runner: Runner, table: AppliedTable | None, prompts: list[str] | None
) -> QualityBook:
    identity = runner.identity()
    return QualityBook(
        study,
        getattr(runner, "measure_quality", None) if unmeasurable(runner) is None else None,
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


def default_scenario(scenario: Scenario, runner: Runner, space: SearchSpace) -> Scenario:
    """For a study run made without a plan: a `supplied` quality SLO resolved against the
    runner and its model's shipped table, as plan_quality resolves it."""
    table = _applied_table(None, runner.identity()["model"])
    return _apply_supplied(scenario, f"scenario {scenario.name}", runner, table, space)[0]


def _prompts(runner: Runner, path: Path | None) -> list[str] | None:
    return None if unmeasurable(runner) is not None else load_eval_prompts(path)


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


def unmeasurable(runner: Runner) -> str | None:
    """Why the runner cannot measure quality in this study (None: it measures KL and top-1)."""
    if getattr(runner, "measure_quality", None) is None:
        return f"the {runner.identity()['runner']} runner measures no quality"
    why = getattr(runner, "quality_unmeasurable", None)
    return None if why is None else why()


def _lacking(
    figure: str, measures: bool, table: AppliedTable | None, space: SearchSpace
) -> list[tuple[str, float]]:
    """The searched pairs whose `figure` no source of this run supplies."""
    if measures and figure in RUNNER_MEASURES:
        return []
    return [
        pair
        for pair in _pairs(space)
        if table is None or getattr(table.figure(pair), figure, None) is None
    ]


def _where_lacking(
    model: str, table: AppliedTable | None, figure: str, lacking: list[tuple[str, float]]
) -> str:
    if table is None:
        return f"no quality table covers the model {model!r}"
    return f"{table.source} gives no {figure} for {pair_key(lacking[0])}"


def _apply_supplied(
    scenario: Scenario,
    source: str,
    runner: Runner,
    table: AppliedTable | None,
    space: SearchSpace,
) -> tuple[Scenario, list[str]]:
    """A `supplied` SLO keeps the forms this run's sources supply (at least one); the notes say
    which apply and why the others do not."""
    slo = scenario.quality
    if slo is None or slo.apply != "supplied":
        return scenario, []
    why_not = unmeasurable(runner)
    model = runner.identity()["model"]
    lacking = {f: _lacking(f, why_not is None, table, space) for f in slo.bounds()}
    supplied = [f for f, pairs in lacking.items() if not pairs]

    if not supplied:
        missing = (
            _where_lacking(model, table, "", [])
            if table is None
            else f"{table.source} gives none of {', '.join(lacking)} for every searched pair"
        )
        raise InputError(
            f"{source}: quality: this run can supply none of its figures ("
            + (f"{why_not} and " if why_not else "")
            + f"{missing}); give --quality FILE (a table for {model!r}), a runner that measures "
            "KL and top-1 (--runner vllm or llamacpp), or a scenario file with `quality: none`"
        )
    applied = slo.only(supplied)
    origins = [
        "measured by the runner"
        if why_not is None and f in RUNNER_MEASURES
        else (table.source if table is not None else "")
        for f in supplied
    ]
    from_where = ", ".join(dict.fromkeys(origins))
    note = f"quality SLO of {source}: applies {applied.describe()} ({from_where})"
    skipped = [f for f in lacking if f not in supplied]
    if skipped:
        names = ", ".join(QUALITY_SLO_FIELDS[f] for f in skipped)
        measured = why_not is not None and any(f in RUNNER_MEASURES for f in skipped)
        no_table = (
            _where_lacking(model, table, "", []) if table is None else f"{table.source} lacks them"
        )
        note += f"; not {names}: " + (f"{why_not}, and " if measured else "") + no_table
    return scenario.model_copy(update={"quality": applied}), [note]


def table_answered(scenario: Scenario, table: AppliedTable | None, space: SearchSpace) -> Scenario:
    """The scenario with only the quality bounds the table answers for every searched pair
    (what a simulated screen can judge; the real trials measure the rest)."""
    slo = scenario.quality
    if slo is None:
        return scenario
    kept = [f for f in slo.bounds() if not _lacking(f, False, table, space)]
    return scenario.model_copy(update={"quality": slo.only(kept) if kept else None})


def _check_answerable(
    scenario: Scenario, source: str, runner: Runner, table: AppliedTable | None, space: SearchSpace
) -> None:
    """Each figure the SLO bounds must come from the runner or, for every searched pair, the
    table."""
    why_not = unmeasurable(runner)
    name, model = runner.identity()["runner"], runner.identity()["model"]
    for figure in scenario.quality.bounds() if scenario.quality else {}:
        lacking = _lacking(figure, why_not is None, table, space)
        if not lacking:
            continue
        runner_part = (
            f"the {name} runner measures only KL and top-1 agreement"
            if why_not is None
            else why_not
        )
        raise InputError(
            f"{source}: quality.{QUALITY_SLO_FIELDS[figure]}: {runner_part} and "
            f"{_where_lacking(model, table, figure, lacking)}; "
            f"supply the figure with --quality FILE (a table of {figure} per precision"
            + (
                ")"
                if why_not is None
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
    """Read the quality inputs, keep the SLO's forms this run can supply (a `supplied` SLO),
    check that the SLO can be answered, narrow the space where the table alone decides (a
    runner that measures nothing). Raises InputError before any storage."""
    why_not = unmeasurable(runner)
    identity = runner.identity()
    if prompts_path is not None and why_not is not None:
        raise InputError(
            f"--quality-prompts: {why_not} (it reads the quality table); give it with --runner "
            "vllm or llamacpp"
        )
    prompts = _prompts(runner, prompts_path)
    table = _applied_table(quality_path, identity["model"])
    if table is not None:
        _check_coverage(table, space)
    scenario, notes = _apply_supplied(scenario, source, runner, table, space)
    _check_answerable(scenario, source, runner, table, space)
    excluded: list[dict[str, Any]] = []
    if table is not None and why_not is not None and scenario.quality is not None:
        space, excluded = _narrow(scenario, source, table, space)
    return QualityPlan(table, prompts, space, scenario, notes, excluded)
