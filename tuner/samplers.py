"""Optuna samplers by name; every one of them honours the SLA constraints set on each trial."""

from __future__ import annotations

import importlib.util

import optuna

from objectives.userfile import InputError
from search_spaces.space import ROLE_KNOBS, SearchSpace

SAMPLERS = ("auto", "tpe", "gp", "nsga2", "random", "grid")
GP_MODULES = ("torch", "scipy")  # Optuna's GPSampler needs both, from its first fitted trial on
GP_HINT = "pip install 'autotune[gp]'"


def gp_missing() -> str | None:
    """The first module GP needs that is not installed, or None. find_spec does not import torch
    (seconds) for a study that may never fit a model."""
    return next((module for module in GP_MODULES if importlib.util.find_spec(module) is None), None)


def resolve(name: str, simulated: bool) -> str:
    """`auto` weighs a trial's cost against a proposal's. A real engine's trial costs minutes, so
    fewer trials win: GP, where PyTorch and SciPy are installed (on the sim grid it reaches 95% of
    the best capacity in fewer trials than TPE on every preset: docs/search.md).
    A simulated trial costs under a second and a GP proposal 1-3 s, so on the simulator TPE's
    cheap proposals reach a good config sooner in wall time, and the default study stays well
    under a minute."""
    if name != "auto":
        return name
    return "gp" if not simulated and gp_missing() is None else "tpe"


def describe(name: str, simulated: bool) -> str:
    """One line for the console: which sampler runs, and for `auto`, why."""
    chosen = resolve(name, simulated)
    if name != "auto":
        return chosen
    if simulated:
        return (
            "tpe (auto: simulated trials are cheap, and TPE's proposals cheaper; "
            "gp is for real engines)"
        )
    if chosen == "gp":
        return "gp (auto: a real engine's trials are costly, and PyTorch and SciPy are installed)"
    return f"tpe (auto: no {gp_missing()}; {GP_HINT} for gp, which needs fewer real trials)"


def tpe(seed: int | None = None) -> optuna.samplers.TPESampler:
    # constant_liar keeps parallel workers from proposing the same config.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


def make_sampler(
    name: str, seed: int, space: SearchSpace, trials: int, simulated: bool = False
) -> optuna.samplers.BaseSampler:
    name = resolve(name, simulated)
    if name == "tpe":
        return tpe(seed)
    if name == "gp":
        missing = gp_missing()
        if missing is not None:
            raise InputError(
                f"--sampler gp needs PyTorch and SciPy ({missing} is missing): "
                f"{GP_HINT} (or pick tpe)"
            )
        # GPSampler treats running trials as pending points, so parallel workers spread out.
        return optuna.samplers.GPSampler(seed=seed)
    if name == "nsga2":
        # Optuna's default population of 50 would leave a short study entirely random.
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(50, trials // 4))
        )
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        deployment = space.ranges.get("deployment")
        searched = [k for k in ROLE_KNOBS if k in space.distributions()]
        if deployment is not None and deployment.choices is not None and searched:
            raise InputError(
                "--sampler grid: a grid over both deployments repeats every co-located point "
                f"for each value of {', '.join(searched)} (co-located trials ignore them): fix "
                "them, or fix deployment, in a --space file, or use another sampler"
            )
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    raise InputError(f"--sampler: unknown sampler {name!r}; allowed: {', '.join(SAMPLERS)}")
