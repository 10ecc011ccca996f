"""Random scenarios over the space users have, for bench/bench_search.py.

A scenario is drawn, from one numpy generator seeded by `--seed`, as:

- prompt and reply lengths: a shape (short chat, code completion, RAG / long document up to 8k
  prompt tokens, long generation), then a median within that shape's range (log-uniform) and a
  distribution around it (fixed, uniform, normal or lognormal, bounded);
- arrival: Poisson (35%), gamma with burstiness 0.2..1 (35%) or a closed loop of 1..64 requests
  in flight, fewer than `num_requests` (30%); an open loop's rate is drawn log-uniform around
  the rate the simulated engine could sustain for those lengths (1/30 to 1.5 times it), so
  scenarios from idle to heavily loaded come out;
- SLA: TTFT p99 from tight to loose (log-uniform, 0.5 to 40 times one prompt's rough prefill
  time, at least 100 ms); half of them a TPOT p99 too (15..150 ms), a fifth a success rate
  below 1 (0.95..0.99);
- `num_requests` (default 32) and a capacity search to 10% (`load.precision` 0.1): modest, so
  the grid's ground truth stays affordable.

Each one is built through the Scenario pydantic model (so it validates) and must have at least
one SLA-feasible config in the grid: `usable` evaluates a fixed random sample of grid points
(every one a grid point, so one feasible among them proves the grid has one) and the draw is
redrawn otherwise, as is a draw the model refuses; `draw` returns how many were redrawn. The
sample (48 points) may miss a grid whose feasible configs are very rare: such scenarios are
redrawn too, a bias towards scenarios where a feasible config is not a needle in a haystack.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
from pydantic import ValidationError

from objectives.scenario import Scenario

# (name, prompt median range, reply median range) in tokens
SHAPES = (
    ("chat", (48, 600), (32, 400)),
    ("code-completion", (400, 2000), (8, 128)),
    ("rag", (1000, 4000), (64, 512)),
    ("document", (3000, 6500), (128, 768)),
    ("generation", (64, 512), (300, 900)),
)
MAX_PROMPT = 8192
MAX_REPLY = 1024
PREFILL_TOKENS_PER_S = 12_000.0  # rough prefill speed of the default simulated engine (bf16)
DECODE_TOKENS_PER_S = 1_500.0  # rough batched decode throughput, for the rate's scale


def _loguniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(np.exp(rng.uniform(np.log(low), np.log(high))))


def _length(rng: np.random.Generator, median: float, cap: int) -> dict:
    median = max(1.0, min(float(median), cap * 0.8))
    kind = rng.choice(["fixed", "uniform", "normal", "lognormal"], p=[0.1, 0.3, 0.3, 0.3])
    if kind == "fixed":
        return {"kind": "fixed", "value": max(1, round(median))}
    if kind == "uniform":
        spread = rng.uniform(0.2, 0.9)
        low = max(1, round(median * (1 - spread)))
        return {"kind": "uniform", "low": low, "high": min(cap, round(median * (1 + spread)))}
    if kind == "normal":
        std = median * rng.uniform(0.05, 0.3)
        return {
            "kind": "normal",
            "mean": median,
            "std": std,
            "min": max(1, round(median - 3 * std)),
            "max": min(cap, round(median + 3 * std)),
        }
    sigma = rng.uniform(0.2, 0.9)
    return {
        "kind": "lognormal",
        "median": median,
        "sigma": sigma,
        "min": max(1, round(median * np.exp(-2.5 * sigma))),
        "max": min(cap, max(round(median) + 1, round(median * np.exp(2.5 * sigma)))),
    }


def draw_one(rng: np.random.Generator, name: str, num_requests: int) -> Scenario:
    shape, prompt_range, reply_range = SHAPES[rng.integers(len(SHAPES))]
    prompt_median = _loguniform(rng, *prompt_range)
    reply_median = _loguniform(rng, *reply_range)
    input_tokens = _length(rng, prompt_median, MAX_PROMPT)
    output_tokens = _length(rng, reply_median, MAX_REPLY)
    prefill_s = prompt_median / PREFILL_TOKENS_PER_S
    # rough requests/s one engine sustains: bounded by prefill and by batched decode
    sustainable = 1.0 / (prefill_s + reply_median / DECODE_TOKENS_PER_S)
    kind = rng.choice(["poisson", "gamma", "closed"], p=[0.35, 0.35, 0.3])
    if kind == "closed":
        # a capacity search needs more requests than are in flight
        choices = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < num_requests]
        arrival: dict = {"kind": "closed", "concurrency": int(rng.choice(choices))}
    else:
        rate = round(_loguniform(rng, sustainable / 30, sustainable * 1.5), 3)
        arrival = {"kind": kind, "rate": max(rate, 0.01)}
        if kind == "gamma":
            arrival["burstiness"] = round(rng.uniform(0.2, 1.0), 2)
    sla: dict = {"ttft_p99_ms": round(max(100.0, 1000 * prefill_s * _loguniform(rng, 0.5, 40)))}
    if rng.uniform() < 0.5:
        sla["tpot_p99_ms"] = round(_loguniform(rng, 15, 150), 1)
    if rng.uniform() < 0.2:
        sla["min_success_rate"] = round(rng.uniform(0.95, 0.99), 3)
    return Scenario.model_validate(
        {
            "name": name,
            "description": f"random {shape} scenario",
            "workload": {
                "arrival": arrival,
                "num_requests": num_requests,
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "seed": int(rng.integers(1_000_000)),
            },
            "sla": sla,
            "load": {"precision": 0.1},
        }
    )


def sample_points(
    grid: dict[str, list], count: int, seed: int, keep: Callable[[dict], bool] = lambda p: True
) -> list[dict]:
    """`count` grid points that `keep` accepts, the same for a given grid and seed."""
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    points = [p for p in points if keep(p)]
    rng = np.random.default_rng(seed)
    return [points[i] for i in rng.choice(len(points), size=min(count, len(points)), replace=False)]


def draw(
    count: int,
    seed: int,
    usable: Callable[[Scenario], bool],
    num_requests: int = 32,
    max_redraws: int = 1000,
) -> tuple[list[Scenario], int]:
    """`count` scenarios that `usable` accepts, and how many draws it refused on the way."""
    rng = np.random.default_rng(seed)
    scenarios: list[Scenario] = []
    redrawn = 0
    while len(scenarios) < count:
        try:
            scenario = draw_one(rng, f"random-s{seed}-{len(scenarios):02d}", num_requests)
        except ValidationError:  # a draw the Scenario model refuses is redrawn too
            scenario = None
        if scenario is not None and usable(scenario):
            scenarios.append(scenario)
            continue
        redrawn += 1
        if redrawn > max_redraws:
            raise RuntimeError(f"{redrawn} random scenarios had no SLA-feasible config; giving up")
    return scenarios, redrawn
