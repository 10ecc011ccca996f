"""The `autotune` command line: the tuning run itself (`autotune`, `autotune worker`) and every
subcommand, each in its own module."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import warnings

import click
import optuna

from objectives.userfile import InputError
from tuner import __version__
from tuner.budget import split
from tuner.cli_options import tune_options, worker_options
from tuner.cli_run import finish, tune
from tuner.console import err
from tuner.fit_command import scenario_group
from tuner.nightly_command import nightly_cmd
from tuner.one_chip import seed_co_located, wants_one_chip_first
from tuner.parallel import sim_processes
from tuner.prepare import prepare, report_outputs
from tuner.sim_commands import calibrate_cmd, profile_hardware_cmd
from tuner.study_commands import export_cmd, history, pareto, report_cmd, scenarios


def _interrupt_on_sigterm() -> None:
    """systemd and Kubernetes stop with SIGTERM: treat it as Ctrl-C so the engine is stopped too."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@tune_options
@click.version_option(__version__, prog_name="autotune")
@click.pass_context
def cli(
    ctx,
    trials,
    timeout_s,
    polish_trials,
    repeats,
    hold_factor,
    export_path,
    html_path,
    no_html,
    **options,
):
    """Tune an LLM serving config for a scenario's SLA: `autotune --scenario customer-service`.

    --trials is every trial this run measures: the study's, then the arms' and polish's
    (--polish of them), and the pick's repeats; the console says the split. (A chip budget's
    first run may start with a one-chip study of its own, on the same split, said then.)
    """
    if ctx.invoked_subcommand is not None:
        return
    outputs = report_outputs(export_path, html_path, no_html)
    budget = split(
        trials,
        polish_trials,
        repeats,
        simulated=options["runner_name"] == "sim",
        grid=options["sampler"] == "grid",
    )
    prepared = prepare(trials=budget.study, outputs=outputs, **options)
    err.print(budget.describe(), markup=False, soft_wrap=True)
    started = time.monotonic()
    if wants_one_chip_first(prepared):
        one_chip = prepare(
            trials=budget.study,
            outputs={},
            **(options | {"chips": 1, "study_name": None, "baseline_path": None}),
        )
        err.print(
            f"note: on --chips {options['chips']} a co-located config runs one chip's config on "
            f"each chip: one chip's study first ({one_chip.study.study_name}, on a budget of "
            f"its own: {budget.study + budget.polish} trials)",
            markup=False,
            soft_wrap=True,
        )
        tune(one_chip, budget.study, timeout_s, polish_trials=budget.polish)
    seeded, _ = seed_co_located(prepared, limit=budget.study)
    if seeded is not None:
        err.print(f"note: {seeded}", markup=False, soft_wrap=True)
    if timeout_s is not None:  # one --timeout for both studies
        timeout_s = max(0.0, timeout_s - (time.monotonic() - started))
    # the queued configs are the study's first trials
    reports = tune(prepared, budget.study, timeout_s, polish_trials=budget.polish)
    finish(prepared, reports, outputs, hold_factor, budget.repeats)


@cli.command()
@worker_options
def worker(trials, timeout_s, export_path, html_path, no_html, **options):
    """One of many workers sharing a study (e.g. one per host on PostgreSQL).

    --trials is the total for the study: all workers together run exactly that many. Workers do
    not polish, repeat or hold the pick (they would measure the same configs side by side): a plain
    `autotune` run on the study afterwards does.
    """
    outputs = report_outputs(export_path, html_path, no_html)
    prepared = prepare(trials=trials, outputs=outputs, **options)
    finish(
        prepared, tune(prepared, trials, timeout_s, study_total=trials, polish_trials=0), outputs
    )


for command in (
    nightly_cmd,
    scenario_group,
    history,
    scenarios,
    pareto,
    report_cmd,
    export_cmd,
    profile_hardware_cmd,
    calibrate_cmd,
):
    cli.add_command(command)


# A full disk or quota, wherever the write was (stdout, the database): one line, not a traceback.
FULL_DEVICE = (errno.ENOSPC, errno.EDQUOT)


def main() -> None:
    # Heartbeats are used with ask/tell on purpose (each trial runs in our own loop).
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize"
    )
    _interrupt_on_sigterm()
    try:
        sim_processes()  # a bad AUTOTUNE_SIM_PROCESSES is refused before a study opens
        cli.main(standalone_mode=False)
    except InputError as error:
        err.print(
            f"autotune: error: {' '.join(str(error).splitlines())}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("autotune: interrupted; finished trials are kept", markup=False)
        sys.exit(130)
    except click.ClickException as error:
        err.print(
            f"autotune: error: {error.format_message()}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
    except OSError as error:
        if error.errno not in FULL_DEVICE:
            raise
        # Python flushes stdout once more at exit, which would fail again with a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        err.print(
            f"autotune: error: cannot write: {error.strerror}; finished trials are kept",
            markup=False,
            highlight=False,
        )
        sys.exit(1)
