"""The exported config: knobs, their engine-native forms, what was measured and where."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

import tuner
from search_spaces.knobs import LLAMACPP_GGUF_TYPES, render
from objectives.userfile import load_yaml
from tuner.outputs import write_atomic


class ExportedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    autotune_version: str
    exported_at: str
    study: str
    trial: int
    scenario: str
    sla: dict[str, Any]
    runner: str
    engine: str
    model: str
    hardware: str
    knobs: dict[str, Any]
    native: dict[str, Any]
    capacity: dict[str, Any] | None = None  # what one instance sustains within the SLA
    metrics: dict[str, Any]


def native_forms(knobs: dict[str, Any]) -> dict[str, Any]:
    """MindIE's config.json fragment and the equivalent `vllm serve` and `llama-server` arguments."""
    mindie = render("mindie", knobs)
    forms: dict[str, Any] = {
        "mindie": {
            "config_json": mindie.get("config", {}),
            "weights_precision": mindie.get("weights", "bf16"),
            **({"env": mindie["env"]} if "env" in mindie else {}),
        }
    }
    try:
        vllm = render("vllm", knobs)
        forms["vllm"] = {"serve_args": vllm.get("args", []), "weights_precision": vllm.get("weights", knobs.get("quantization", "bf16"))}
    except ValueError as error:
        forms["vllm"] = {"not_expressible": str(error)}
    precision = knobs.get("quantization", "bf16")
    try:
        if precision not in LLAMACPP_GGUF_TYPES:
            raise ValueError(f"llama.cpp has no GGUF type for {precision}")
        forms["llamacpp"] = {"server_args": render("llamacpp", knobs).get("args", []),
                             "gguf_type": LLAMACPP_GGUF_TYPES[precision]}
    except ValueError as error:
        forms["llamacpp"] = {"not_expressible": str(error)}
    return forms


# Trial attributes that are no measurement of the config (or too long for a deploy file).
NOT_EXPORTED = ("knobs", "capacity_steps", "status")


def capacity_summary(metrics: dict[str, Any], peak_rate: float | None) -> dict[str, Any] | None:
    """Capacity per instance and, for a stated peak, the instances it needs (fleet sizing)."""
    if "capacity_rate" not in metrics:
        return None
    summary = {
        "rate": metrics["capacity_rate"],
        "rate_unit": metrics.get("capacity_rate_unit", "req/s"),
        "requests_per_s": metrics["capacity_rps"],
        "output_tokens_per_s": metrics["capacity_output_tokens_per_s"],
        "ttft_p99_ms": metrics.get("capacity_ttft_p99_ms"),
        "at_ceiling": metrics.get("capacity_at_ceiling", False),
        "time_limited": metrics.get("capacity_time_limited", False),
    }
    if peak_rate is not None:
        summary |= {"peak_rate": peak_rate, "instances_for_peak": metrics.get("instances_for_peak")}
    return summary


def build_export(study: str, trial: int, scenario: str, sla: dict, identity: dict[str, str],
                 knobs: dict[str, Any], metrics: dict[str, Any], peak_rate: float | None = None) -> ExportedConfig:
    return ExportedConfig(
        autotune_version=tuner.__version__,
        exported_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        study=study,
        trial=trial,
        scenario=scenario,
        sla=sla,
        runner=identity["runner"],
        engine=identity["engine"],
        model=identity["model"],
        hardware=identity["hardware"],
        knobs=knobs,
        native=native_forms(knobs),
        capacity=capacity_summary(metrics, peak_rate),
        metrics={key: value for key, value in metrics.items() if key not in NOT_EXPORTED},
    )


def write_export(path: Path, exported: ExportedConfig) -> None:
    header = "# Written by autotune. `native` holds the settings ready to deploy.\n"
    write_atomic(path, header + yaml.safe_dump(exported.model_dump(), sort_keys=False))


def load_export(path: Path) -> ExportedConfig:
    return load_yaml(path, ExportedConfig)
