"""A night fed the latest traffic (`autotune nightly --trace FILE`): the log read as the study's
trace (or in a named format), its traffic compared with the traffic the study was tuned on, and
where it drifted, the scenario the night re-tunes and measures on.

Both sides are read from the requests a trial replays (runners.load.workload: the study's draws
or its trace's window, and tonight's log), so a parametric study and a trace study compare alike:

- rate: requests per second over the load (an open loop's);
- burstiness: the coefficient of variation of the gaps between arrivals (Poisson's is 1);
- prompt and output lengths: their means (what prefill and decode cost), p50 and p99 (the tail
  that sets TTFT p99 and the context);
- prefix share: the share of prompt tokens in a prompt start another prompt shares.

Each has a stated threshold (THRESHOLDS): past it the figure has drifted. They sit above what one
service's traffic moves between the halves of an ordinary hour (the Azure conversation hour's:
rate -1%, burstiness +3%, prompt mean -13%, p50 -4%, p99 +10%, output mean -9%, p50 -12%, p99
-5%) and at what changes a config's answer (a rate 20% higher asks 20% more of a capacity the
config may not have). p90 is left out: on a two-humped length (that hour's prompts) it sits on
the cliff between them, and the same halves move it 41%.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from objectives.scenario import Scenario
from objectives.trace import FORMATS, window_span
from objectives.userfile import InputError, describe_validation_error
from runners.load.workload import NO_PREFIX, Requests, make_requests

QUANTILES = (50, 99)
NAMED_FORMATS = tuple(f for f in FORMATS if f not in ("csv", "jsonl"))  # known columns
# Past these, a figure has drifted: relative changes, but the prefix share's (a share's change
# is in points: 0.05 to 0.10 doubles a share that barely matters).
THRESHOLDS = {"rate": 0.20, "burstiness": 0.25, "mean": 0.20, "quantile": 0.25, "prefix": 0.10}


@dataclass(frozen=True)
class Traffic:
    """What a load offers, as DRIFT compares it."""

    requests: int
    rate: float | None  # req/s; None: a closed loop (requests follow answers)
    burstiness: float | None  # the gaps' coefficient of variation; None: a closed loop
    input_mean: float
    output_mean: float
    input_tokens: tuple[float, ...]  # at QUANTILES
    output_tokens: tuple[float, ...]
    prefix_share: float

    def as_record(self) -> dict[str, object]:
        return asdict(self)


def traffic_of(requests: Requests) -> Traffic:
    arrivals = requests.arrival_s
    rate = burstiness = None
    if arrivals is not None and arrivals.size > 1:
        ordered = np.sort(arrivals)
        rate = float(ordered.size / window_span(ordered - ordered[0], None))
        gaps = np.diff(ordered)
        burstiness = float(gaps.std() / gaps.mean()) if gaps.mean() > 0 else 0.0
    inputs = requests.input_tokens.astype(np.float64)
    return Traffic(
        len(requests),
        rate,
        burstiness,
        float(inputs.mean()),
        float(requests.output_tokens.mean()),
        tuple(float(q) for q in np.percentile(inputs, QUANTILES)),
        tuple(float(q) for q in np.percentile(requests.output_tokens, QUANTILES)),
        float(_shared_tokens(requests).sum() / inputs.sum()),
    )


def _shared_tokens(requests: Requests) -> np.ndarray:
    """Per prompt, its tokens in a start another prompt shares: a shared prefix, and a session
    turn's history (its session's earlier prompts and answers, as a log's turns share theirs)."""
    shared = np.zeros(len(requests), dtype=np.int64)
    if requests.prefix is not None:
        sharing = requests.prefix != NO_PREFIX
        if requests.prefix_sizes is not None:  # a trace's keys, each of its own length
            # (a log whose blocks never repeat has no keys at all)
            sizes = np.zeros(len(requests), dtype=np.int64)
            sizes[sharing] = requests.prefix_sizes[requests.prefix[sharing]]
        else:
            sizes = np.full(len(requests), requests.prefix_tokens)
        shared = np.where(sharing, np.minimum(sizes, requests.input_tokens), 0)
    if requests.sessions is not None:
        shared = np.maximum(shared, requests.input_tokens - requests.sessions.new_tokens)
    return shared


@dataclass(frozen=True)
class Change:
    figure: str  # "rate", "burstiness", "input p99", ...
    before: float
    after: float
    change: float  # relative, or in points for the prefix share
    threshold: float

    @property
    def drifted(self) -> bool:
        return abs(self.change) > self.threshold

    def describe(self) -> str:
        if self.figure == "prefix share":
            moved = f"{self.change * 100:+.1f} points"
            limit = f"{self.threshold * 100:.0f} points"
        else:
            moved, limit = f"{self.change:+.0%}", f"{self.threshold:.0%}"
        return f"{self.figure} {moved} ({self.before:.4g} -> {self.after:.4g}; threshold {limit})"


def compare(before: Traffic, after: Traffic) -> list[Change]:
    """Every figure both sides have, with its change; `drifted` says which crossed."""
    pairs: list[tuple[str, float | None, float | None, str]] = [
        ("rate", before.rate, after.rate, "rate"),
        ("burstiness", before.burstiness, after.burstiness, "burstiness"),
    ]
    for name in ("input", "output"):
        old_mean, new_mean = getattr(before, f"{name}_mean"), getattr(after, f"{name}_mean")
        pairs.append((f"{name} mean", old_mean, new_mean, "mean"))
        old, new = getattr(before, f"{name}_tokens"), getattr(after, f"{name}_tokens")
        pairs += [(f"{name} p{q}", old[i], new[i], "quantile") for i, q in enumerate(QUANTILES)]
    changes = [
        Change(figure, old, new, new / old - 1, THRESHOLDS[kind])
        for figure, old, new, kind in pairs
        if old is not None and new is not None and old > 0
    ]
    share = after.prefix_share - before.prefix_share
    changes.append(
        Change("prefix share", before.prefix_share, after.prefix_share, share, THRESHOLDS["prefix"])
    )
    return changes


def drifted(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.drifted]


def tonights_scenario(
    study: Scenario, trace_file: Path, trace_format: str | None
) -> tuple[Scenario, list[str]]:
    """The study's scenario replaying tonight's log, whole, and notes on what of the study's it
    does not carry. The log is read as the study's own trace (its format, columns, rate
    multiple and context policy; not its window, which was a place in another log), or, for a
    study of drawn traffic, in `trace_format`. The log's own arrivals replace a drawn burst,
    so its bound (sla.burst_ttft_p99_ms) goes with it; absolute search bounds (load.min_rate,
    max_rate) move with the nominal rate. InputError naming the flag where the log cannot be
    read so."""
    own = study.workload.trace
    if own is not None:
        if trace_format is not None and trace_format != own.format:
            raise InputError(
                f"--trace-format: {trace_format} is not the study's trace format ({own.format}); "
                "a night compares like with like: give a log in that format"
            )
        keep = {"file", "sha256", "context_tokens", "over_context_requests"}
        keep |= {"start_s", "duration_s", "requests"}
        spec = own.model_dump(exclude_none=True, exclude=keep)
    elif trace_format is None:
        raise InputError(
            f"--trace-format: the study's scenario ({study.name}) draws its traffic, so the log's "
            f"format is needed: one of {', '.join(NAMED_FORMATS)}"
        )
    elif trace_format not in NAMED_FORMATS:
        raise InputError(
            f"--trace-format: {trace_format} needs a column map, which the scenario holds: tune "
            "a study on a scenario whose workload.trace names it, then run its nights"
        )
    else:
        spec = {"format": trace_format}
    data = study.model_dump(mode="json", exclude_none=True)
    data["workload"] = {
        "seed": study.workload.seed,
        "trace": spec | {"file": str(trace_file.expanduser().absolute())},
    }
    notes = []
    if data["sla"].pop("burst_ttft_p99_ms", None) is not None:
        notes.append(
            "tonight's log is replayed with its own arrivals: the study's drawn burst and its "
            "bound (sla.burst_ttft_p99_ms) are not applied; its TTFT p99 bound is kept"
        )
    bounds = {k: data["load"].pop(k) for k in ("min_rate", "max_rate") if k in data["load"]}
    tonight = _validated(data, trace_file)
    if bounds and not study.closed_loop:  # (a closed loop's bounds are requests in flight)
        # (bound / nominal first: a bound equal to the nominal rate stays equal to it)
        scale = tonight.nominal_rate
        data["load"] |= {k: scale * (v / study.nominal_rate) for k, v in bounds.items()}
        tonight = _validated(data, trace_file)
    return tonight, notes


def _validated(data: dict, trace_file: Path) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(f"--trace {trace_file}", error)) from None


def traffic_study_name(study_name: str, tonight: Scenario) -> str:
    """Tonight's traffic gets a study of its own (a study's figures stand on one workload),
    named for the log's content: a night on the same log resumes it."""
    trace = tonight.workload.trace
    assert trace is not None and trace.sha256 is not None, "a read trace has its sha256"
    return f"{study_name}.traffic-{trace.sha256[:12]}"


def traffic_section(changes: list[Change], study_name: str | None) -> list[str]:
    """The night report's lines on tonight's traffic."""
    moved = drifted(changes)
    if moved:
        lines = ["## TRAFFIC DRIFT: " + "; ".join(c.describe() for c in moved), ""]
        lines.append(f"Re-tuned on tonight's traffic as study `{study_name}`.")
    else:
        lines = ["## Traffic: no drift (every figure within its threshold)"]
    lines += [
        "",
        "| figure | study's traffic | tonight's | change | threshold |",
        "|---|---|---|---|---|",
    ]
    for c in changes:
        points = c.figure == "prefix share"
        change = f"{c.change * 100:+.1f} pt" if points else f"{c.change:+.1%}"
        limit = f"{c.threshold * 100:.0f} pt" if points else f"{c.threshold:.0%}"
        mark = " **drift**" if c.drifted else ""
        lines.append(f"| {c.figure} | {c.before:.4g} | {c.after:.4g} | {change}{mark} | {limit} |")
    return [*lines, ""]


def study_traffic(scenario: Scenario) -> Traffic:
    return traffic_of(make_requests(scenario.workload))
