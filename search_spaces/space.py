"""A search space: a range per knob, loaded from an engine preset and narrowed by a user's file."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from pydantic import BaseModel, ConfigDict, model_validator

from objectives.scenario import Workload
from objectives.userfile import InputError, load_yaml, validate
from search_spaces.knobs import ENGINES, KNOBS, Knob

# Knobs only a disaggregated deployment reads (search_spaces.deployment).
ROLE_KNOBS = (
    "prefill_instances",
    "decode_instances",
    "prefill_batch_size",
    "prefill_memory_share",
    "decode_memory_share",
)
# Knobs that act on shared prompt prefixes only (runners.sim.prefix_cache).
PREFIX_KNOBS = ("prefix_caching", "kv_host_gb")
# Preemption binds where memory runs out as conversations' contexts grow.
SESSION_KNOBS = ("swap_preemptions",)
GRID_POINTS = 6  # values per numeric knob when --sampler grid has no explicit `grid`


class KnobRange(BaseModel):
    """One of: `value` (fixed), `choices`, or `low`/`high` (with `step` or `log`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: Any = None
    choices: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    grid: list[float] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        forms = [
            self.value is not None,
            self.choices is not None,
            self.low is not None or self.high is not None,
        ]
        if sum(forms) != 1:
            raise ValueError("give exactly one of: value, choices, or low and high")
        if self.choices is not None and not self.choices:
            raise ValueError("choices is empty")
        if forms[2]:
            if self.low is None or self.high is None:
                raise ValueError("a range needs both low and high")
            if self.low > self.high:
                raise ValueError(f"range is reversed: low {self.low:g} > high {self.high:g}")
            if self.step is not None and self.step <= 0:
                raise ValueError("step must be positive")
            if self.log and (self.step is not None or self.low <= 0):
                raise ValueError("a log range needs low > 0 and no step")
        return self

    def listed(self) -> list[Any] | None:
        """The values the knob may take when they are listed (a fixed value, or choices);
        None for a numeric range."""
        if self.value is not None:
            return [self.value]
        return list(self.choices) if self.choices is not None else None


class SpaceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: str | None = None
    knobs: dict[str, KnobRange]


def _check_range(knob: Knob, spec: KnobRange, source: str) -> None:
    where = f"{source}: knobs.{knob.name}"
    values = spec.listed()
    if knob.kind == "categorical":
        allowed = list(knob.allowed or ())
        if values is None:
            raise InputError(
                f"{where}: a categorical knob takes choices or value, allowed: {allowed}"
            )
        bad = [v for v in values if v not in allowed]
        if bad:
            raise InputError(f"{where}: {bad[0]!r} is not allowed; allowed: {allowed}")
        return
    assert knob.limits is not None, f"numeric knob {knob.name} has limits"
    low, high = knob.limits
    numbers = values if values is not None else [spec.low, spec.high]
    for number in numbers:
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            raise InputError(f"{where}: {number!r} is not a number")
        if knob.kind == "int" and float(number) != int(number):
            raise InputError(f"{where}: {number!r} is not an integer")
        if knob.low_exclusive and not low < number <= high:
            raise InputError(
                f"{where}: {number:g} is outside the allowed range ({low:g}, {high:g}]"
            )
        if not low <= number <= high:
            raise InputError(f"{where}: {number:g} is outside the allowed range {low:g}..{high:g}")
    if spec.low is not None and spec.high is not None and spec.step is not None:
        width = spec.high - spec.low
        if not math.isclose(width / spec.step, round(width / spec.step)):
            raise InputError(
                f"{where}: high - low ({width:g}) is not a multiple of step {spec.step:g}"
            )


class SearchSpace:
    """The knobs of one engine and the ranges the study explores."""

    def __init__(
        self,
        engine: str,
        ranges: dict[str, KnobRange],
        notes: list[str] | None = None,
        source: str = "",
        user_set: frozenset[str] = frozenset(),
        hard_ends: dict[str, tuple[float, str]] | None = None,
        chips: int = 1,
    ):
        self.engine = engine
        self.ranges = ranges
        self.notes = notes or []
        self.source = source or f"preset {engine}"  # where the ranges came from, for messages
        # Knobs whose range a --space file gave: the runner narrows them only to what can run,
        # never widens them.
        self.user_set = user_set
        # "knob.low" / "knob.high" -> the furthest that end may go for this workload on this
        # runner, and why (the longest prompt, what memory holds).
        self.hard_ends = hard_ends or {}
        self.chips = chips  # the chip budget (search_spaces.deployment)

    def _with(self, ranges: dict[str, KnobRange], notes: list[str]) -> SearchSpace:
        return SearchSpace(
            self.engine, ranges, notes, self.source, self.user_set, dict(self.hard_ends), self.chips
        )

    @classmethod
    def load(cls, engine: str, user_file: Path | None = None) -> SearchSpace:
        if engine not in ENGINES:
            raise InputError(f"--engine: unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")
        with resources.as_file(
            resources.files("search_spaces") / "presets" / f"{engine}.yaml"
        ) as path:
            preset = load_yaml(path, SpaceFile)
        ranges = dict(preset.knobs)
        source = str(user_file) if user_file else f"preset {engine}"
        if user_file is not None:
            user = load_yaml(user_file, SpaceFile)
            if user.engine not in (None, engine):
                raise InputError(
                    f"{user_file}: engine: the file is for {user.engine!r}, "
                    f"the study runs {engine!r}"
                )
            ranges.update(user.knobs)
        user_set = frozenset(user.knobs) if user_file is not None else frozenset()
        notes = []
        for name, spec in list(ranges.items()):
            knob = KNOBS.get(name)
            if knob is None:
                raise InputError(f"{source}: knobs.{name}: unknown knob; known: {', '.join(KNOBS)}")
            _check_range(knob, spec, source)
            if engine not in knob.render:
                if name in user_set and spec.value:  # a setting the study could not honour
                    why = knob.lacking.get(engine, "it has no such setting")
                    raise InputError(
                        f"{source}: knobs.{name}: {engine} cannot express it ({why}); leave it "
                        "out or study an engine that has it"
                    )
                notes.append(f"{name} dropped: {engine} cannot express it")
                del ranges[name]
        space = cls(engine, ranges, notes, f"--space {user_file}" if user_file else "", user_set)
        for name in list(space.ranges):
            allowed = KNOBS[name].engine_allowed.get(engine)
            if allowed is not None:
                space = space.restrict(name, allowed, f"--engine {engine} takes only these values")
        return space

    def restrict(self, name: str, allowed: tuple | list, why: str) -> SearchSpace:
        """Keep only `allowed` values of a knob (a numeric range becomes the allowed values in
        it)."""
        spec = self.ranges.get(name)
        if spec is None:
            return self
        values = spec.listed()
        if values is None:
            assert spec.low is not None and spec.high is not None, "a range has both ends"
            values = [v for v in allowed if spec.low <= v <= spec.high]
        kept = [v for v in values if v in allowed]
        if not kept:
            raise InputError(
                f"{self.source}: knobs.{name}: none of {values} can run here ({why}); "
                f"allowed: {list(allowed)}"
            )
        if kept == values and spec.low is None:
            return self
        ranges = dict(self.ranges)
        ranges[name] = (
            KnobRange(value=kept[0]) if spec.value is not None else KnobRange(choices=kept)
        )
        notes = self.notes if kept == values else [*self.notes, f"{name} limited to {kept}: {why}"]
        return self._with(ranges, notes)

    def drop(self, name: str, why: str) -> SearchSpace:
        if name not in self.ranges:
            return self
        ranges = {k: v for k, v in self.ranges.items() if k != name}
        return self._with(ranges, [*self.notes, f"{name} dropped: {why}"])

    def fit_workload(
        self, workload: Workload, scenario_source: str = "the scenario"
    ) -> SearchSpace:
        """The space for this workload: prefix caching only where prompts share a prefix or a
        session's turns share its history (else every value measures alike, and trials spent
        on it are lost), and max_prefill_tokens' floor at the longest prompt (below it no
        prompt could start on MindIE or on vLLM without chunked prefill; llama-server splits a
        longer prompt into batches)."""
        self._check_host_tier()
        space = self
        shared = workload.shared_prefix is not None and workload.shared_prefix.share > 0
        shared = shared or workload.trace_shares_prompts
        if not shared and workload.sessions is None:
            for name in PREFIX_KNOBS:
                if name not in self.user_set:
                    space = space.drop(name, "the workload's prompts share no prefix")
        if workload.sessions is None:
            for name in SESSION_KNOBS:
                if name in space.ranges and name not in self.user_set:
                    space = space.drop(
                        name, "searched with sessions, whose growing contexts preempt"
                    )
        if self.engine == "llamacpp":  # llama-server takes a prompt in batches of -b tokens
            return space
        return space._fit_prefill_floor(workload, scenario_source)

    def _check_host_tier(self) -> None:
        """A host tier is read through the prefix cache (search_spaces.engines.violations):
        with every kv_host_gb above 0 and prefix_caching fixed off, every trial would fail."""
        host, cache = self.ranges.get("kv_host_gb"), self.ranges.get("prefix_caching")
        if host is None or cache is None or cache.listed() is None or any(cache.listed() or []):
            return
        hosts = host.listed()
        if (hosts is not None and all(hosts)) or (hosts is None and (host.low or 0) > 0):
            raise InputError(
                f"{self.source}: knobs.kv_host_gb: every value needs prefix_caching, which "
                "knobs.prefix_caching fixes off (the host tier is read through the prefix "
                "cache); allowed: prefix_caching true, or kv_host_gb 0"
            )

    def _fit_prefill_floor(self, workload: Workload, scenario_source: str) -> SearchSpace:
        spec = self.ranges.get("max_prefill_tokens")
        need = workload.longest_prompt
        if spec is None:
            return self
        if spec.low is None or spec.high is None:  # a fixed value or a list of choices
            listed = spec.listed() or []
            if listed and max(listed) < need:
                raise InputError(
                    f"{self.source}: knobs.max_prefill_tokens: "
                    f"{', '.join(f'{v:g}' for v in listed)} is below the longest prompt of "
                    f"{scenario_source} ({need} tokens): no prompt that long could start"
                )
            kept = [v for v in listed if v >= need]
            if len(kept) == len(listed):
                return self
            return self.restrict("max_prefill_tokens", kept, f"the longest prompt is {need} tokens")
        if spec.low >= need:
            space = self._with(dict(self.ranges), list(self.notes))
            space.hard_ends["max_prefill_tokens.low"] = (
                need,
                f"the longest prompt is {need} tokens",
            )
            return space
        if spec.high < need:
            raise InputError(
                f"{self.source}: knobs.max_prefill_tokens: the whole range "
                f"{spec.low:g}..{spec.high:g} is below the longest prompt of {scenario_source} "
                f"({need} tokens)"
            )
        low = (
            need
            if spec.step is None
            else spec.low + math.ceil((need - spec.low) / spec.step) * spec.step
        )
        ranges = dict(self.ranges)
        ranges["max_prefill_tokens"] = spec.model_copy(update={"low": low})
        note = (
            f"max_prefill_tokens floor raised from {spec.low:g} to {low:g} (longest prompt {need})"
        )
        space = self._with(ranges, [*self.notes, note])
        space.hard_ends["max_prefill_tokens.low"] = (need, f"the longest prompt is {need} tokens")
        return space

    def with_chips(self, chips: int, ranges: dict[str, KnobRange] | None = None) -> SearchSpace:
        """The space on a chip budget (search_spaces.deployment), with `ranges` if given."""
        return SearchSpace(
            self.engine,
            self.ranges if ranges is None else ranges,
            self.notes,
            self.source,
            self.user_set,
            dict(self.hard_ends),
            chips,
        )

    def with_range(self, name: str, spec: KnobRange, note: str) -> SearchSpace:
        ranges = dict(self.ranges)
        ranges[name] = spec
        return self._with(ranges, [*self.notes, note])

    def with_ceiling(self, name: str, ceiling: int, why: str) -> SearchSpace:
        """Set the top of a preset's numeric range to what this engine, model and hardware can
        use (`why`); a range from a --space file is only lowered to it, never raised."""
        spec = self.ranges.get(name)
        if spec is None or spec.low is None or spec.high is None:
            return self
        if spec.step:  # stay on the range's own grid
            ceiling = int(spec.low + (ceiling - spec.low) // spec.step * spec.step)
        ranges, notes = dict(self.ranges), list(self.notes)
        if ceiling < spec.low:
            notes.append(f"{name} range {spec.low:g}..{spec.high:g} kept, above {ceiling}: {why}")
        elif ceiling < spec.high or (ceiling > spec.high and name not in self.user_set):
            ranges[name] = spec.model_copy(update={"high": ceiling})
            verb = "raised" if ceiling > spec.high else "lowered"
            notes.append(f"{name} ceiling {verb} from {spec.high:g} to {ceiling}: {why}")
        space = self._with(ranges, notes)
        space.hard_ends[f"{name}.high"] = (ceiling, why)
        return space

    def distributions(self) -> dict[str, BaseDistribution]:
        dists: dict[str, BaseDistribution] = {}
        for name, spec in self.ranges.items():
            knob = KNOBS[name]
            if spec.value is not None:
                continue
            if spec.choices is not None:
                dists[name] = CategoricalDistribution(spec.choices)
            elif spec.low is None or spec.high is None:
                raise AssertionError(f"knobs.{name}: a range has both ends (KnobRange)")
            elif knob.kind == "int":
                step = 1 if spec.log else int(spec.step or 1)
                dists[name] = IntDistribution(
                    int(spec.low), int(spec.high), log=spec.log, step=step
                )
            else:
                dists[name] = FloatDistribution(spec.low, spec.high, log=spec.log, step=spec.step)
        return dists

    def fixed(self) -> dict[str, Any]:
        return {name: spec.value for name, spec in self.ranges.items() if spec.value is not None}

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """The config a trial runs. MindIE needs maxPrefillBatchSize <= maxBatchSize: a sampled
        value above the batch size runs as the batch size. Sampling it in a range that depended
        on the batch size would make the space dynamic, which multivariate TPE cannot model
        jointly (docs/search.md). A grid keeps its points as they are, and a point
        above the batch size is refused as infeasible."""
        params = {name: _suggest(trial, name, dist) for name, dist in self.distributions().items()}
        grid = isinstance(trial.study.sampler, optuna.samplers.GridSampler)
        return self.config_of(params, clamp=not grid)

    def config_of(self, params: dict[str, Any], clamp: bool = True) -> dict[str, Any]:
        """The config sampled `params` run as (suggest): the fixed knobs added, the prefill
        batch clamped to the batch size (unless `clamp` is off: a grid's points), the
        deployment's knobs settled."""
        config = self.fixed() | params
        sampled = params.get("max_prefill_batch_size")
        if sampled is not None and clamp:
            config["max_prefill_batch_size"] = min(sampled, config.get("batch_size", sampled))
        return self._deployment(config)

    def _deployment(self, config: dict[str, Any]) -> dict[str, Any]:
        """A co-located trial runs without the role knobs (sampled all the same: a space that
        changed with the deployment would be dynamic); a disaggregated one decodes on the rest
        of the chip budget unless the space sets decode_instances."""
        if "deployment" not in config:
            return config
        if config["deployment"] != "disaggregated":
            return {k: v for k, v in config.items() if k not in ROLE_KNOBS}
        if "decode_instances" not in config:
            config["decode_instances"] = self.chips - int(config["prefill_instances"])
        return config

    def grid(self) -> dict[str, list[Any]]:
        """Values per sampled knob for Optuna's GridSampler."""
        grid: dict[str, list[Any]] = {}
        for name, dist in self.distributions().items():
            spec = self.ranges[name]
            if isinstance(dist, CategoricalDistribution):
                grid[name] = list(dist.choices)
            elif spec.grid is not None:
                grid[name] = list(spec.grid)
            elif not isinstance(dist, (IntDistribution, FloatDistribution)):
                raise AssertionError(f"knobs.{name}: unexpected distribution {dist!r}")
            elif dist.log:
                grid[name] = sorted(
                    {
                        dist.high,
                        *(
                            2.0**k
                            for k in range(
                                math.ceil(math.log2(dist.low)), math.floor(math.log2(dist.high)) + 1
                            )
                        ),
                    }
                )
            else:
                step = dist.step or (dist.high - dist.low) / (GRID_POINTS - 1)
                points = np.linspace(dist.low, dist.high, GRID_POINTS)
                grid[name] = sorted(
                    {dist.low + round((p - dist.low) / step) * step for p in points}
                )
            if isinstance(dist, IntDistribution):
                grid[name] = sorted({int(v) for v in grid[name]})
        return grid

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        """Known constraints that need no measurement; the hardware's own are the runner's."""
        reasons = []
        if config.get("max_prefill_tokens", math.inf) < workload.longest_prompt:
            reasons.append(
                f"max_prefill_tokens {config['max_prefill_tokens']} < "
                f"longest prompt {workload.longest_prompt}"
            )
        if config.get("deployment") == "disaggregated":
            used = config["prefill_instances"] + config["decode_instances"]
            if used > self.chips:
                reasons.append(
                    f"prefill_instances {config['prefill_instances']} + decode_instances "
                    f"{config['decode_instances']} = {used} chips > --chips {self.chips}"
                )
            if config["decode_instances"] < 1:
                reasons.append(f"no chip left for a decode instance within --chips {self.chips}")
        if config.get("max_prefill_batch_size", 0) > config.get("batch_size", math.inf):
            reasons.append(
                f"max_prefill_batch_size {config['max_prefill_batch_size']} > "
                f"batch_size {config['batch_size']}"
            )
        return reasons


def nearest_value(dist: BaseDistribution, value: Any) -> Any:
    """The value of a distribution nearest to `value`: on a numeric one's step within its
    ends, or the nearest of a --space file's listed choices."""
    if isinstance(dist, CategoricalDistribution):
        numbers = [c for c in dist.choices if isinstance(c, (int, float))]
        return min(numbers, key=lambda choice: abs(choice - value), default=dist.choices[0])
    assert isinstance(dist, (IntDistribution, FloatDistribution)), dist
    nearest = min(max(value, dist.low), dist.high)
    if dist.step:
        nearest = dist.low + round((nearest - dist.low) / dist.step) * dist.step
    return int(nearest) if isinstance(dist, IntDistribution) else float(nearest)


def _suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, FloatDistribution), dist
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def parse_config(engine: str, data: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate a knob -> value mapping (e.g. a baseline file's knobs) against the knob table."""
    config = {}
    for name, value in data.items():
        knob = KNOBS.get(name)
        if knob is None:
            raise InputError(f"{source}: knobs.{name}: unknown knob; known: {', '.join(KNOBS)}")
        _check_range(knob, validate(KnobRange, {"value": value}, f"{source}: knobs.{name}"), source)
        config[name] = value
    return config
