"""The exported config: knobs, their engine-native forms, what was measured and where."""

from __future__ import annotations

import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial
from pydantic import BaseModel, ConfigDict

import tuner
from objectives.scenario import Scenario, Workload
from objectives.userfile import load_yaml
from runners.load.capacity import sustained_tokens_per_s
from search_spaces.deployment import deployment_label, is_disaggregated
from search_spaces.engines import llamacpp_args, mindie_model_deploy, violations, vllm_args
from search_spaces.knobs import KNOBS, LLAMACPP_GGUF_TYPES, render
from tuner.cost import CHIP_COST_ATTR, cost_figures
from tuner.export_pd import pd_forms, replicated
from tuner.hold import held_capacity
from tuner.outputs import write_atomic
from tuner.quality import quality_summary
from tuner.study import CAPACITY_HINT, HOLD_ATTR, PRUNE_BELOW, REPEATS_ATTR, trial_knobs


class ExportedConfig(BaseModel):
    """With a chip budget (`chips`, from `autotune --chips N` of 2 or more), `deployment` says
    how the chips serve ("co-located" replicas, or "xPyD": x prefill and y decode instances),
    `native` holds the deployment (tuner.export_pd) and every throughput and capacity figure is
    per chip. Both are absent from a one-chip study's export, and from exports written before
    chip budgets: those load as they are."""

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
    chips: int | None = None  # the chip budget; None: one chip
    deployment: str | None = None  # deployment_label: "co-located", "2P6D"; None: one chip
    knobs: dict[str, Any]
    native: dict[str, Any]
    # what one instance (with a chip budget: one chip) sustains within the SLA
    capacity: dict[str, Any] | None = None
    # With --chip-cost-per-hour: the chip's price and tuner.cost's figures at capacity.
    cost: dict[str, Any] | None = None
    quality: dict[str, Any] | None = (
        None  # what the precision and KV setting cost in accuracy, and its source
    )
    # The pick held at its claimed capacity for `factor` times the scenario's requests before
    # the export (tuner.hold): each rate tried, and the one that held (`capacity` is its).
    hold: dict[str, Any] | None = None
    # Real engines: the pick measured again with fresh arrivals (tuner.repeats), its throughput
    # over the repeats, the noise they showed and the rivals it tied with.
    repeats: dict[str, Any] | None = None
    metrics: dict[str, Any]

    def document(self) -> dict[str, Any]:
        """The YAML's content: a one-chip study's export has no chip budget or deployment, as
        before chip budgets."""
        data = self.model_dump()
        return {k: v for k, v in data.items() if v is not None or k not in _LEFT_OUT_WHEN_ABSENT}


# Left out when absent: a one-chip study's export has no chip budget or deployment, a
# simulated one no repeats, an export without a hold none.
_LEFT_OUT_WHEN_ABSENT = ("chips", "deployment", "hold", "repeats")


def _mindie_form(
    knobs: dict[str, Any], workload: Workload, ran: list[str] | None
) -> dict[str, Any]:
    mindie = render("mindie", knobs)
    deploy: dict[str, Any] = mindie_model_deploy(workload.longest_prompt, workload.longest_request)
    if "model_config" in mindie:  # the fields of the model's entry the knobs set
        deploy["ModelConfig"] = [mindie["model_config"]]
    backend = mindie.get("config", {}) | {"ModelDeployConfig": deploy}
    return {
        # MindIE 1.0 and later read these under BackendConfig (as the runner writes them): at
        # the top level a pasted conf/config.json would be ignored.
        "config_json": {"BackendConfig": backend},
        "weights_precision": mindie.get("weights", "bf16"),
        **({"env": mindie["env"]} if "env" in mindie else {}),
    }


def _vllm_form(knobs: dict[str, Any], workload: Workload, ran: list[str] | None) -> dict[str, Any]:
    return {
        "serve_args": vllm_args(knobs, workload) if ran is None else ran,
        "weights_precision": knobs.get("quantization", "bf16"),
    }


def _llamacpp_form(
    knobs: dict[str, Any], workload: Workload, ran: list[str] | None
) -> dict[str, Any]:
    return {
        "server_args": llamacpp_args(knobs, workload) if ran is None else ran,
        "gguf_type": LLAMACPP_GGUF_TYPES[knobs.get("quantization", "bf16")],
    }


_FORMS = {"mindie": _mindie_form, "vllm": _vllm_form, "llamacpp": _llamacpp_form}


def native_forms(
    knobs: dict[str, Any],
    workload: Workload,
    engine: str | None = None,
    engine_args: list[str] | None = None,
    chips: int | None = None,
    role_args: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """MindIE's config.json fragment and the `vllm serve` and `llama-server` arguments of a
    config for the workload, rendered as the runners render them (search_spaces.engines), less
    host, port and local paths. The trial's own `engine` keeps the `engine_args` it ran with
    (its runner settings included: threads, extra arguments); an engine that would refuse the
    config says why instead. On a budget of `chips`: a co-located config's forms say the
    replicas and their router; a disaggregated config gets each engine's deployment form
    instead (tuner.export_pd: each role's servers as a deployment runs them, rendered for the
    deployment's own connector; `role_args`, each role's arguments as a real trial ran them, sit
    beside it as trial_serve_args)."""
    if is_disaggregated(knobs):
        return pd_forms(knobs, workload, role_args)
    forms: dict[str, Any] = {}
    for name, form in _FORMS.items():
        ran = engine_args if name == engine else None
        refused = [] if ran is not None else violations(name, knobs, workload)
        try:
            forms[name] = (
                {"not_expressible": "; ".join(refused)} if refused else form(knobs, workload, ran)
            )
        except ValueError as error:  # a knob value the engine has no setting for
            forms[name] = {"not_expressible": str(error)}
        lacks = lacking(name, knobs)
        if lacks and "not_expressible" not in forms[name]:
            forms[name]["not_expressed"] = lacks
    if chips is not None and chips > 1:
        forms = {name: replicated(form, chips) for name, form in forms.items()}
    return forms


def lacking(engine: str, knobs: dict[str, Any]) -> dict[str, str]:
    """The knobs the config sets that the engine's form leaves out, and why (the engine runs
    without them: what was measured with them does not carry over)."""
    return {
        name: KNOBS[name].lacking[engine]
        for name, value in knobs.items()
        if value and name in KNOBS and engine in KNOBS[name].lacking
    }


# Trial attributes that are no measurement of the config (or too long for a deploy file).
NOT_EXPORTED = (
    "knobs",
    "capacity_steps",
    CAPACITY_HINT,
    PRUNE_BELOW,
    "status",
    "engine_args",
)


def capacity_summary(
    metrics: dict[str, Any], peak_rate: float | None, chips: int | None = None
) -> dict[str, Any] | None:
    """Capacity per instance (per chip on a chip budget) and, for a stated peak, the instances
    (chips) it needs: fleet sizing."""
    if "capacity_rate" not in metrics:
        return None
    summary = {
        "rate": metrics["capacity_rate"],
        "rate_unit": metrics.get("capacity_rate_unit", "req/s"),
        # offered: the rate of the load that met every SLO; delivered: what it served
        "requests_per_s": metrics["capacity_rps"],
        "delivered_share": metrics.get("capacity_delivered_share"),
        # what it sustains, as the pick rule ranks it: an open loop's rate times the mean
        # output length (runners.load.capacity.sustained_tokens_per_s); then as measured
        "output_tokens_per_s": metrics["capacity_output_tokens_per_s"],
        **(
            {"measured_output_tokens_per_s": metrics["capacity_measured_output_tokens_per_s"]}
            if "capacity_measured_output_tokens_per_s" in metrics
            else {}
        ),
        "ttft_p99_ms": metrics.get("capacity_ttft_p99_ms"),
        "tpot_p99_ms": metrics.get("capacity_tpot_p99_ms"),
        "at_ceiling": metrics.get("capacity_at_ceiling", False),
        # the rate the search found, where a longer hold lowered it (tuner.hold); `held: false`
        # where no rate held
        **(
            {"lowered_from": metrics["capacity_lowered_from"]}
            if "capacity_lowered_from" in metrics
            else {}
        ),
        **({"held": False} if metrics.get("capacity_unheld") else {}),
        "time_limited": metrics.get("capacity_time_limited", False),
    }
    if peak_rate is not None:
        # on a chip budget the capacity is per chip, so the count is chips, not deployments
        fleet = "chips_for_peak" if chips is not None else "instances_for_peak"
        summary |= {"peak_rate": peak_rate, fleet: metrics.get("instances_for_peak")}
    return summary


def build_export(
    study: str,
    trial: int,
    scenario: str,
    sla: dict,
    identity: dict[str, str],
    knobs: dict[str, Any],
    metrics: dict[str, Any],
    peak_rate: float | None = None,
    *,
    workload: Workload,
    chip_cost_per_hour: float | None = None,
    hold: dict[str, Any] | None = None,
    repeats: dict[str, Any] | None = None,
) -> ExportedConfig:
    """`metrics` are the trial's attributes: its measurements and the engine arguments it ran
    with. `identity` holds "chips" for a study on a chip budget. A `hold` (tuner.hold) that
    lowered the claim gives the capacity figures of the rate that held."""
    chips = int(identity["chips"]) if "chips" in identity else None
    measured, metrics = metrics, _held(metrics, hold, peak_rate, workload)
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
        chips=chips,
        deployment=deployment_label(knobs),
        knobs=knobs,
        native=native_forms(
            knobs,
            workload,
            identity["engine"],
            metrics.get("engine_args"),
            chips,
            {
                role: metrics[f"runner_engine_args_{role}"]
                for role in ("prefill", "decode")
                if f"runner_engine_args_{role}" in metrics
            }
            or None,
        ),
        capacity=capacity_summary(metrics, peak_rate, chips),
        cost=(
            {"chip_per_hour": chip_cost_per_hour} | cost_figures(metrics, chip_cost_per_hour)
            if chip_cost_per_hour is not None
            else None
        ),
        quality=quality_summary(metrics),
        hold=hold,
        repeats=repeats,
        metrics={  # as the trial measured them (`capacity` is the hold's where it lowered it)
            key: value
            for key, value in measured.items()
            if key not in NOT_EXPORTED and not key.startswith("quality_")
        },  # those are in `quality`
    )


def _held(
    metrics: dict[str, Any],
    hold: dict[str, Any] | None,
    peak_rate: float | None,
    workload: Workload,
) -> dict[str, Any]:
    """The trial's capacity figures replaced by those of the rate its hold held at, where the
    hold lowered the claim."""
    if hold is None or hold["held_rate"] == hold["claimed_rate"] or "capacity_rate" not in metrics:
        return metrics
    if hold["held_rate"] is None:  # no rate held: the claim stands unconfirmed, no fleet on it
        return dict(metrics) | {"capacity_unheld": True, "instances_for_peak": None}
    load = next(load for load in hold["loads"] if load["rate"] == hold["held_rate"])
    held = dict(metrics) | {
        "capacity_rate": load["rate"],
        "capacity_rps": load["requests_per_s"],
        "capacity_output_tokens_per_s": sustained_tokens_per_s(
            workload, load["rate"], load["output_tokens_per_s"]
        ),
        "capacity_measured_output_tokens_per_s": load["output_tokens_per_s"],
        "capacity_ttft_p99_ms": load["ttft_p99_ms"],
        "capacity_tpot_p99_ms": load["tpot_p99_ms"],
        "capacity_delivered_share": load["delivered_share"],
        "capacity_lowered_from": hold["claimed_rate"],
    }
    if peak_rate is not None and load["requests_per_s"]:
        held["instances_for_peak"] = math.ceil(peak_rate / load["requests_per_s"])
    return held


def trial_export(study: optuna.Study, trial: FrozenTrial) -> ExportedConfig:
    """A study's trial as the export holds it (`--export`, the report's raw YAML)."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    return build_export(
        study.study_name,
        trial.number,
        scenario.name,
        scenario.sla.model_dump(),
        study.user_attrs["identity"],
        trial_knobs(study, trial),
        dict(trial.user_attrs),
        scenario.load.peak_rate,
        workload=scenario.workload,
        chip_cost_per_hour=study.user_attrs.get(CHIP_COST_ATTR),
        hold=held_capacity(study.user_attrs.get(HOLD_ATTR), trial.number),
        repeats=_repeats_of(study.user_attrs.get(REPEATS_ATTR), trial.number),
    )


def _repeats_of(repeated: dict[str, Any] | None, trial: int) -> dict[str, Any] | None:
    if repeated is None or str(trial) not in repeated["trials"]:
        return None
    runs = repeated["trials"][str(trial)]
    values = runs["throughput"]  # None: a repeat that failed
    return {
        "measurements": len(values),
        "throughput": values,
        "median": statistics.median(v for v in values if v is not None),
        "worst": min(
            v if met and v is not None else 0.0 for v, met in zip(values, runs["met"], strict=True)
        ),
        "ttft_p99_ms": runs["ttft_p99_ms"],
        "noise": repeated["noise"],
        "tied_with": repeated["tied"] if repeated["pick"] == trial else [],
    }


def write_export(path: Path, exported: ExportedConfig) -> None:
    header = "# Written by autotune. `native` holds the settings ready to deploy.\n"
    write_atomic(path, header + yaml.safe_dump(exported.document(), sort_keys=False))


def load_export(path: Path) -> ExportedConfig:
    return load_yaml(path, ExportedConfig)
