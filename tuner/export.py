"""The exported config: knobs, their engine-native forms, what was measured and where."""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

import tuner
from search_spaces.knobs import LLAMACPP_GGUF_TYPES, render
from tuner.userfile import InputError, load_yaml


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


def build_export(study: str, trial: int, scenario: str, sla: dict, identity: dict[str, str],
                 knobs: dict[str, Any], metrics: dict[str, Any]) -> ExportedConfig:
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
        metrics=metrics,
    )


def check_writable(path: Path) -> None:
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise InputError(f"--export: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InputError(f"--export: directory {parent} is not writable")
    if path.is_dir():
        raise InputError(f"--export: {path} is a directory")


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target, then rename over it: readers see the old file or the new one."""
    path = path.expanduser()
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_export(path: Path, exported: ExportedConfig) -> None:
    header = "# Written by autotune. `native` holds the settings ready to deploy.\n"
    write_atomic(path, header + yaml.safe_dump(exported.model_dump(), sort_keys=False))


def load_export(path: Path) -> ExportedConfig:
    return load_yaml(path, ExportedConfig)
