"""The SLA-feasible Pareto front as the console shows it: at the end of a run, and by
`autotune pareto`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from objectives.scenario import Scenario
from objectives.scoring import throughput_label
from search_spaces.deployment import deployment_label
from tuner.quality import describe_figures, quality_summary
from tuner.storage import ParetoSnapshot


def front_table(
    title: str, rows: list[dict[str, Any]], best: int | None, scenario: Scenario
) -> Table:
    """One row per member (snapshot_rows), the exported one (`best`) starred. Rows of a study on
    a chip budget carry their deployment ("deploy": co-located, or xPyD), and their throughputs
    are per chip."""
    capacity = scenario.load.mode == "capacity"
    peak = scenario.load.peak_rate
    labels = [deployment_label(row["params"]) for row in rows]
    deployed = any(label is not None for label in labels)
    per_chip = "\nper chip" if deployed else ""  # a second header line: the table stays narrow
    table = Table(title=title)
    columns = [
        "trial",
        f"TTFT p99 ms @{scenario.nominal_rate:g}{per_chip}",
        throughput_label(scenario) + per_chip,
    ]
    if capacity:
        columns.append("capacity " + ("in flight" if scenario.closed_loop else "req/s") + per_chip)
    if capacity and peak:
        columns.append(f"instances @{peak:g}/s")
    if deployed:
        columns.append("deploy")
    columns += ["batch", "first", "prefill tok", "quant", "kv", "quality", "p99 n"]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row, label in zip(rows, labels, strict=True):
        p, m = row["params"], row["metrics"]
        cells = [
            f"{row['trial']}{' *' if row['trial'] == best else ''}",
            f"{row['ttft_p99_ms']:.1f}",
            f"{row['output_tokens_per_s']:.0f}",
        ]
        if capacity:
            # measured requests/s at capacity (what sizes the fleet), or requests in flight
            rate = m.get("capacity_rate") if scenario.closed_loop else m.get("capacity_rps") or None
            cells.append(
                "-" if rate is None else f"{rate:.3g}{'+' if m.get('capacity_at_ceiling') else ''}"
            )
        if capacity and peak:
            cells.append(str(m.get("instances_for_peak") or "-"))
        if deployed:
            cells.append(label or "-")
        cells += [
            str(p.get("batch_size", "")),
            str(p.get("select_batch", "")).removesuffix("-first"),
            str(p.get("max_prefill_tokens", "")),
            str(p.get("quantization", "")),
            str(p.get("kv_compression", "")),
            describe_figures(m),
            str(m.get("ttft_samples", "")),
        ]
        table.add_row(*cells)
    return table


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
