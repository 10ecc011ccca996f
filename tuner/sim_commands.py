"""`autotune profile-hardware` and `autotune calibrate`: the simulator's figures, measured."""

from __future__ import annotations

import math
from datetime import date
from pathlib import Path

import click
import optuna
import yaml
from rich.table import Table

from objectives.scenario import Scenario
from objectives.userfile import InputError
from runners.sim.calibration import METRICS, Fitted, error_summary, error_table, fit, split_held_out
from runners.sim.profiles import HardwareProfile, hardware_names, load_hardware, load_model
from runners.sim.profiling import DEVICES, profile_hardware
from runners.sim.runner import SIM_ENGINES, SimRunner
from tuner import flags
from tuner.console import out
from tuner.observations import study_observations
from tuner.outputs import write_atomic
from tuner.prepare import check_outputs, user_file
from tuner.storage import DEFAULT_STORAGE, load_study, sqlite_file

# The profile whose engine-side figures (memory share, runtime reserve, prefill overhead) a
# measured profile starts from, per device.
BASE_PROFILE = {"cpu": "h100", "cuda": "h100", "npu": "ascend-910b2"}


def write_profile(path: Path, profile: HardwareProfile, header: str) -> None:
    body = yaml.safe_dump(
        profile.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=200
    )
    write_atomic(path, f"# {header}\n{body}")


@click.command("profile-hardware")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option(
    "--model",
    default="qwen2-7b",
    show_default=True,
    help="built-in model or a HF model directory: its shapes are measured",
)
@click.option(
    "--base",
    help="profile whose engine figures are kept (default: h100 for cpu/cuda, ascend-910b2 for npu)",
)
@click.option("--name", help="the profile's name (default: the output file's name)")
@click.option(
    "-o",
    "--output",
    "output_path",
    type=flags.OUTPUT_FILE,
    required=True,
    help="the hardware YAML to write",
)
def profile_hardware_cmd(device, model, base, name, output_path):
    """Measure this machine's accelerator with PyTorch and write a hardware profile for the
    simulator."""
    check_outputs({"-o": output_path}, {"--base": user_file(base)})
    shapes = load_model(model)
    base_profile = load_hardware(base, "--base") if base else load_hardware(BASE_PROFILE[device])
    profile = profile_hardware(
        device, shapes, base_profile, name or output_path.stem, progress=out.print
    )
    write_profile(
        output_path,
        profile,
        f"measured by `autotune profile-hardware --device {device}` at {shapes.name}'s shapes",
    )
    table = Table(title=f"{profile.name}: {profile.description}")
    for column in ("figure", "value", "source", "how"):
        table.add_column(column)
    for key, figure in profile:
        if hasattr(figure, "source"):
            table.add_row(key, f"{figure.value:.4g}", figure.source, figure.note.split(";")[0])
    out.print(table)
    out.print(f"profile: {output_path} (use it with --hardware {output_path})", markup=False)


def _summary_table(
    title: str,
    before: list[dict],
    after: list[dict],
    held_before: list[dict],
    held_after: list[dict],
) -> Table:
    """Median and worst |% error| per metric on the loads fitted, and the median on loads held
    out of a fit on the others (what to expect of configs the fit never saw)."""
    table = Table(title=title)
    for column in (
        "metric",
        "median |error| before",
        "after",
        "held-out before",
        "held-out after",
        "worst before",
        "worst after",
        "n",
        "n held out",
    ):
        table.add_column(column, justify="right")
    b, a, hb, ha = (error_summary(rows) for rows in (before, after, held_before, held_after))
    pct = lambda x: "inf" if math.isinf(x) else f"{x:.1f}%"  # noqa: E731
    for key in METRICS:
        if key in a:
            held = (
                (pct(hb[key][0]), pct(ha[key][0]), str(ha[key][2]))
                if key in ha
                else ("-", "-", "0")
            )
            table.add_row(
                key,
                pct(b[key][0]),
                pct(a[key][0]),
                *held[:2],
                pct(b[key][1]),
                pct(a[key][1]),
                str(a[key][2]),
                held[2],
            )
    return table


def _trial_table(rows: list[dict]) -> Table:
    table = Table(title="per load: simulated / measured (error)")
    for column in ("trial", "rate", *METRICS):
        table.add_column(column, justify="right")
    loads: dict[tuple, dict] = {}
    for r in rows:
        cell = (
            "failed"
            if r["simulated"] is None
            else f"{r['simulated']:.3g} / {r['measured']:.3g} ({r['error_pct']:+.0f}%)"
        )
        loads.setdefault((r["trial"], r["rate"]), {})[r["metric"]] = cell
    for (trial, rate), cells in loads.items():
        table.add_row(str(trial), f"{rate:.3g}", *(cells.get(key, "-") for key in METRICS))
    return table


@click.command("calibrate")
@click.option(
    "--storage",
    default=DEFAULT_STORAGE,
    show_default=True,
    help="SQLAlchemy URL of the study storage",
)
@click.option("--study", "study_name", help="a study of real trials (default: the only study)")
@click.option(
    "--hardware",
    help="the profile to start from (default: the study's hardware, when it names a profile)",
)
@click.option("--model", help="built-in model or HF model directory (default: the study's)")
@click.option(
    "--engine", help=f"whose scheduler to simulate (default: the study's): {', '.join(SIM_ENGINES)}"
)
@click.option(
    "--iterations", type=flags.COUNT, default=150, show_default=True, help="simulated fits to try"
)
@click.option("--seed", type=flags.SEED, default=0, show_default=True)
@click.option(
    "-o",
    "--output",
    "output_path",
    type=flags.OUTPUT_FILE,
    required=True,
    help="the calibrated hardware YAML",
)
def calibrate_cmd(storage, study_name, hardware, model, engine, iterations, seed, output_path):
    """Fit the simulator's overheads and efficiencies to a study's real trials."""
    check_outputs(
        {"-o": output_path}, {"--storage": sqlite_file(storage), "--hardware": user_file(hardware)}
    )
    study, _ = load_study(storage, study_name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the fit's own trials are not news
    identity = study.user_attrs.get("identity", {})
    if identity.get("runner") == "sim" or "screens" in study.user_attrs:
        raise InputError(
            f"--study {study.study_name}: its trials are simulated; calibrate needs a study of "
            "real trials (--runner vllm, llamacpp, mindie or openai)"
        )
    # Name what said it.
    source = "--engine" if engine else f"--study {study.study_name}: its engine"
    engine = engine or identity.get("engine")
    if engine not in SIM_ENGINES:
        raise InputError(
            f"{source}: the simulator has no scheduler model for {engine!r}; it models "
            f"{', '.join(SIM_ENGINES)}{'' if source == '--engine' else ' (give --engine)'}"
        )
    hardware = hardware or (
        identity.get("hardware") if identity.get("hardware") in hardware_names() else None
    )
    if hardware is None:
        raise InputError(
            "--hardware: give the profile to start from: one `autotune profile-hardware` wrote "
            f"for this machine, or a preset ({', '.join(hardware_names())})"
        )
    base = load_hardware(hardware)
    model = model or identity.get("model_path") or identity.get("model")
    shapes = load_model(model)
    observations = study_observations(study)
    if not observations:
        raise InputError(
            f"--study {study.study_name}: no real trial with a whole measured load to calibrate "
            "from"
        )
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    trials = len({o.trial for o in observations})
    out.print(
        f"calibrating {base.name} on {len(observations)} loads of {trials} trials "
        f"({engine} scheduler, {shapes.name})"
    )
    make_runner = lambda profile: SimRunner(engine, shapes, profile)  # noqa: E731
    note = (
        f"calibrated {date.today().isoformat()} on {study.study_name} "
        f"({len(observations)} loads of {trials} trials)"
    )
    fitted_part, held_out = split_held_out(observations)
    with out.status("fitting") as status:

        def fitting(what: str, loads: list) -> Fitted:
            return fit(
                loads,
                scenario,
                base,
                make_runner,
                iterations,
                note,
                seed,
                progress=lambda done, best: status.update(
                    f"fitting {what}: {done}/{iterations}, loss {best:.3f}"
                ),
            )

        held_fit = (
            fitting(f"without the {len(held_out)} held-out loads", fitted_part)
            if held_out
            else None
        )
        calibrated, loss_before, loss_after, kept_start = fitting("every load", observations)
    before = error_table(observations, scenario, make_runner(base))
    after = error_table(observations, scenario, make_runner(calibrated))
    held_before = error_table(held_out, scenario, make_runner(base)) if held_fit else []
    held_after = error_table(held_out, scenario, make_runner(held_fit.profile)) if held_fit else []
    out.print(_trial_table(after))
    out.print(
        _summary_table(
            f"{base.name} -> calibrated (loss {loss_before:.3f} -> {loss_after:.3f})",
            before,
            after,
            held_before,
            held_after,
        )
    )
    if held_fit:
        out.print(
            f"held out: {len(held_out)} loads of trials "
            f"{', '.join(map(str, sorted({o.trial for o in held_out})))}, "
            f"scored by a fit on the other {len(fitted_part)} loads"
        )
    else:
        out.print("held out: none (one load: nothing to score a fit on the others with)")
    if kept_start:
        out.print(
            f"no fit beat {base.name} without a fitted metric's median error getting worse: "
            "its figures are kept"
        )
    note += "; no fit beat the start: its figures kept" if kept_start else ""
    calibrated = calibrated.model_copy(
        update={"name": output_path.stem, "description": f"{base.description}; {note}"}
    )
    write_profile(
        output_path, calibrated, f"`autotune calibrate` of {base.name} on study {study.study_name}"
    )
    out.print(f"profile: {output_path} (use it with --hardware {output_path})", markup=False)
