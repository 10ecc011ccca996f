"""The exported config: knobs, their engine-native forms, what was measured and where."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial
from pydantic import BaseModel, ConfigDict

import tuner
from objectives.scenario import Workload
from objectives.userfile import load_yaml
from search_spaces.deployment import deployment_label, is_disaggregated
from search_spaces.engines import llamacpp_args, mindie_model_deploy, violations, vllm_args
from search_spaces.knobs import KNOBS, LLAMACPP_GGUF_TYPES, render
from tuner.answer import Answer, answer
from tuner.export_pd import pd_forms, replicated
from tuner.outputs import write_atomic
from tuner.quality import quality_summary
from tuner.study import CAPACITY_HINT, PRUNE_BELOW, trial_knobs


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
    metrics: dict[str, Any],
    peak_rate: float | None,
    chips: int | None = None,
    trace_multiple: float | None = None,
) -> dict[str, Any] | None:
    """Capacity per instance (per chip on a chip budget) and, for a stated peak, the instances
    (chips) it needs: fleet sizing. A trace's replay states its rate as a multiple of the
    trace's too."""
    if "capacity_rate" not in metrics:
        return None
    summary = {
        "rate": metrics["capacity_rate"],
        "rate_unit": metrics.get("capacity_rate_unit", "req/s"),
        **({"trace_multiple": trace_multiple} if trace_multiple is not None else {}),
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
        # the rate the search found, where the worst repeat or a longer hold lowered it
        # (tuner.answer); `held: false` where no rate held
        **(
            {
                "lowered_from": metrics["capacity_lowered_from"],
                "lowered_by": metrics["capacity_lowered_by"],
            }
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
    study: str, identity: dict[str, str], knobs: dict[str, Any], stated: Answer
) -> ExportedConfig:
    """The export of `stated` (tuner.answer): its capacity and cost those every output states,
    `metrics` as the trial measured them (its engine arguments included). `identity` holds
    "chips" for a study on a chip budget."""
    chips = int(identity["chips"]) if "chips" in identity else None
    scenario, measured, metrics = stated.scenario, dict(stated.trial.user_attrs), stated.metrics
    price = stated.chip_cost_per_hour
    return ExportedConfig(
        autotune_version=tuner.__version__,
        exported_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        study=study,
        trial=stated.trial.number,
        scenario=scenario.name,
        sla=scenario.sla.model_dump(),
        runner=identity["runner"],
        engine=identity["engine"],
        model=identity["model"],
        hardware=identity["hardware"],
        chips=chips,
        deployment=deployment_label(knobs),
        knobs=knobs,
        native=native_forms(
            knobs,
            scenario.workload,
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
        capacity=capacity_summary(
            metrics,
            scenario.load.peak_rate,
            chips,
            scenario.workload.multiple_of(metrics.get("capacity_rate")),
        ),
        cost={"chip_per_hour": price} | stated.cost if price is not None else None,
        quality=quality_summary(metrics),
        hold=stated.hold,
        repeats=stated.repeats,
        metrics={  # as the trial measured them (`capacity` is the answer's)
            key: value
            for key, value in measured.items()
            if key not in NOT_EXPORTED and not key.startswith("quality_")
        },  # those are in `quality`
    )


def trial_export(
    study: optuna.Study,
    trial: FrozenTrial,
    hold: dict[str, Any] | None = None,
    repeats: dict[str, Any] | None = None,
) -> ExportedConfig:
    """A study's trial as the export holds it (`--export`, the report's raw YAML), from this
    run's `hold` and `repeats` (None: those the study keeps for the trial)."""
    return answer_export(study, answer(study, trial, hold, repeats))


def answer_export(study: optuna.Study, stated: Answer) -> ExportedConfig:
    """The export of a study's answer (tuner.answer)."""
    identity, knobs = study.user_attrs["identity"], trial_knobs(study, stated.trial)
    return build_export(study.study_name, identity, knobs, stated)


def write_export(path: Path, exported: ExportedConfig) -> None:
    header = "# Written by autotune. `native` holds the settings ready to deploy.\n"
    write_atomic(path, header + yaml.safe_dump(exported.document(), sort_keys=False))


def load_export(path: Path) -> ExportedConfig:
    return load_yaml(path, ExportedConfig)
