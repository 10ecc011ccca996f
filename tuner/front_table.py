"""The SLA-feasible Pareto front as the console shows it: at the end of a run, and by
`autotune pareto`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from objectives.scenario import Scenario
from objectives.scoring import throughput_label
from search_spaces.deployment import deployment_label
from tuner.answer import Answer
from tuner.cost import cost_figures
from tuner.quality import describe_figures, quality_summary
from tuner.storage import ParetoSnapshot


def front_table(
    title: str,
    rows: list[dict[str, Any]],
    best: int | None,
    scenario: Scenario,
    chip_cost_per_hour: float | None = None,
    stated: Answer | None = None,
) -> Table:
    """One row per member (snapshot_rows), the exported one (`best`) starred; its capacity,
    throughput, fleet and cost are those of `stated` (tuner.answer: where the hold lowered the
    search's claim, the rate that held), as the export and the report state them. Rows of a
    study on a chip budget carry their deployment ("deploy": co-located, or xPyD), and their
    throughputs are per chip."""
    capacity = scenario.load.mode == "capacity"
    peak = scenario.load.peak_rate
    labels = [deployment_label(row["params"]) for row in rows]
    deployed = any(label is not None for label in labels)
    per_chip = "\nper chip" if deployed else ""  # a second header line: the table stays narrow
    table = Table(title=title)
    columns = [
        "trial",
        # the load is per chip; the TTFT is each request's
        f"TTFT p99 ms @{scenario.nominal_rate:g}"
        + ("/chip" if deployed else "")
        + (
            ""
            if scenario.workload.trace is None
            else f" ({scenario.workload.trace.rate_multiple:g}x trace)"
        ),
        throughput_label(scenario) + per_chip,
    ]
    if capacity:
        columns.append(
            "capacity in flight"
            if scenario.closed_loop
            else "capacity req/s\noffered/served" + per_chip.replace("\n", " ")
        )
    if capacity and peak:
        columns.append(f"{'chips' if deployed else 'instances'} @{peak:g}/s")
    if chip_cost_per_hour is not None:
        columns.append(f"cost per\nM out tok @{chip_cost_per_hour:g}/h")
    if deployed:
        columns.append("deploy")
    burst = any("burst_recovered" in row["metrics"] for row in rows)
    if burst:
        columns.append("burst TTFT\np99 ms, recovery")
    columns += ["batch", "first", "prefill tok", "quant", "kv"]
    # searched (or fixed) only where prompts share a prefix (SearchSpace.fit_workload)
    prefix_cache = any("prefix_caching" in row["params"] for row in rows)
    if prefix_cache:
        columns.append("prefix\ncache")
    columns += ["quality", "p99 n"]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    answered = stated if stated is not None and stated.trial.number == best else None
    if answered is not None:  # the answer's figures, as shown
        answer_row = {"output_tokens_per_s": answered.throughput, "metrics": answered.metrics}
        rows = [row | answer_row if row["trial"] == best else row for row in rows]
    shown, alike = _collapse_ties(rows, best)
    captions = []
    if alike:
        captions.append(
            "alike (the same TTFT p99 and throughput as shown): "
            + "; ".join(
                f"trial {kept} and {', '.join(map(str, others))}" for kept, others in alike.items()
            )
        )
    stated_metrics = {} if answered is None else answered.metrics
    if "capacity_lowered_from" in stated_metrics:
        captions.append(
            f"* trial {best}: the capacity its {stated_metrics['capacity_lowered_by']} confirmed, "
            f"lowered from the search's {stated_metrics['capacity_lowered_from']:.4g}"
        )
    if stated_metrics.get("capacity_unheld"):
        captions.append(f"* trial {best}: its capacity is the search's, which no hold confirmed")
    if captions:
        table.caption = "\n".join(captions)
    for row, label in zip(rows, labels, strict=True):
        if row["trial"] not in shown:
            continue
        p, m = row["params"], row["metrics"]
        cells = [
            f"{row['trial']}{' *' if row['trial'] == best else ''}",
            f"{row['ttft_p99_ms']:.1f}",
            f"{row['output_tokens_per_s']:.0f}",
        ]
        if capacity:
            # the rate offered at capacity and the requests/s served there (what sizes the
            # fleet), or requests in flight
            offered, served = m.get("capacity_rate"), m.get("capacity_rps")
            ceiling = "+" if m.get("capacity_at_ceiling") else ""
            if offered is None:
                cells.append("-")
            elif scenario.closed_loop:
                cells.append(f"{offered:.3g}{ceiling}")
            else:
                multiple = scenario.workload.multiple_of(offered)
                times = "" if multiple is None else f" ({multiple:.3g}x)"
                cells.append(f"{offered:.3g}{ceiling} / {served:.3g}{times}")
        if capacity and peak:
            cells.append(str(m.get("instances_for_peak") or "-"))
        if chip_cost_per_hour is not None:
            per_token = cost_figures(m, chip_cost_per_hour).get("per_million_output_tokens")
            cells.append("-" if per_token is None else f"{per_token:.3g}")
        if deployed:
            cells.append(label or "-")
        if burst:
            cells.append(_burst_cell(m))
        cells += [
            str(p.get("batch_size", "")),
            str(p.get("select_batch", "")).removesuffix("-first"),
            str(p.get("max_prefill_tokens", "")),
            str(p.get("quantization", "")),
            str(p.get("kv_compression", "")),
            *([_on_off(p.get("prefix_caching"))] if prefix_cache else []),
            describe_figures(m),
            str(m.get("ttft_samples", "")),
        ]
        table.add_row(*cells)
    return table


def _burst_cell(metrics: dict[str, Any]) -> str:
    p99, recovery = metrics.get("burst_ttft_p99_ms"), metrics.get("burst_recovery_s")
    if p99 is None:
        return "-"
    return f"{p99:.0f}, " + ("never" if recovery is None else f"{recovery:.1f} s")


def _on_off(value: Any) -> str:
    return "-" if value is None else ("on" if value else "off")


def _collapse_ties(
    rows: list[dict[str, Any]], best: int | None
) -> tuple[set[int], dict[int, list[int]]]:
    """One row per TTFT p99 and throughput as the table shows them (ties are configs that differ
    in knobs that did not matter): the trials kept, the exported one where it is among them, and
    each kept trial's alike ones."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        key = (f"{row['ttft_p99_ms']:.1f}", f"{row['output_tokens_per_s']:.0f}")
        groups.setdefault(key, []).append(row["trial"])
    shown, alike = set(), {}
    for trials in groups.values():
        kept = best if best in trials else trials[0]
        shown.add(kept)
        if len(trials) > 1:
            alike[kept] = [t for t in trials if t != kept]
    return shown, alike


def snapshot_rows(snap: ParetoSnapshot) -> list[dict[str, Any]]:
    """The snapshot's members as `front_table` and `pareto --json` take them."""
    return [
        {
            "trial": m.trial_number,
            "ttft_p99_ms": m.ttft_p99_ms,
            "output_tokens_per_s": m.output_tokens_per_s,
            "params": m.params,
            "quality": quality_summary(m.metrics),
            "metrics": m.metrics,
        }
        for m in snap.members
    ]
