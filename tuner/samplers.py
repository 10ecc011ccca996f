"""Optuna samplers by name; every one of them honours the SLA constraints set on each trial."""

from __future__ import annotations

import optuna

from search_spaces.space import SearchSpace
from objectives.userfile import InputError

SAMPLERS = ("tpe", "gp", "nsga2", "random", "grid")


def make_sampler(name: str, seed: int, space: SearchSpace, trials: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        # constant_liar keeps parallel workers from proposing the same config.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if name == "gp":
        try:
            import scipy  # noqa: F401  (Optuna's GPSampler needs both, from its first fitted trial on)
            import torch  # noqa: F401
        except ImportError as error:
            raise InputError(f"--sampler gp needs PyTorch and SciPy ({error.name} is missing): "
                             "pip install 'autotune[gp]' (or pick tpe)") from None
        return optuna.samplers.GPSampler(seed=seed)
    if name == "nsga2":
        # Optuna's default population of 50 would leave a short study entirely random.
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, trials // 4)))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    raise InputError(f"--sampler: unknown sampler {name!r}; allowed: {', '.join(SAMPLERS)}")
