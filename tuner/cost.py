"""The answer in money: a chip's price per hour (`--chip-cost-per-hour`, in whatever currency
the user pays in) against what the config serves at capacity."""

from __future__ import annotations

from typing import Any

CHIP_COST_ATTR = "chip_cost_per_hour"  # the study's attribute, set by the flag


def cost_figures(metrics: dict[str, Any], cost_per_hour: float | None) -> dict[str, float]:
    """Cost per million output tokens at capacity (with `load.mode: fixed`, at the nominal
    rate; throughputs are per chip, so one chip's price buys them) and, with a stated peak, the
    fleet's cost per hour (`instances_for_peak` counts chips). Empty without a price or a
    throughput."""
    if cost_per_hour is None:
        return {}
    figures: dict[str, float] = {}
    tokens_per_s = metrics.get("capacity_output_tokens_per_s", metrics.get("output_tokens_per_s"))
    if tokens_per_s:
        figures["per_million_output_tokens"] = cost_per_hour / (tokens_per_s * 3600) * 1e6
    if metrics.get("instances_for_peak"):
        figures["fleet_per_hour"] = metrics["instances_for_peak"] * cost_per_hour
    return figures


def describe_cost(figures: dict[str, float]) -> str:
    parts = []
    if "per_million_output_tokens" in figures:
        parts.append(f"{figures['per_million_output_tokens']:.3g} per million output tokens")
    if "fleet_per_hour" in figures:
        parts.append(f"{figures['fleet_per_hour']:.4g} per hour for the peak's fleet")
    return ", ".join(parts)
