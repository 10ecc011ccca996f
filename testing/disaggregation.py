"""The seed article's workloads: customer-service as its tables have it, and its
disaggregation caveat as workloads and config grids: what
tests/test_disaggregation.py checks and bench/bench_disaggregation.py prints share them here
(a bench imports nothing from tests/)."""

from __future__ import annotations

from typing import Any

from objectives.scenario import SLA, Fixed, Normal, Poisson, Scenario, Uniform, load_scenario
from runners.load.capacity import evaluate
from runners.sim.runner import SimRunner


def seed_customer_service() -> Scenario:
    """customer-service as the seed article's tables (and the benches measured on it before
    issue 29) have it: 512/128 tokens, no system prompt."""
    base = load_scenario("customer-service")
    workload = base.workload.model_copy(update={"shared_prefix": None})
    return base.model_copy(update={"workload": workload})


def _scenario(name: str, inputs: Any, outputs: Any, rate: float, sla: SLA, n: int) -> Scenario:
    base = seed_customer_service()  # the caveat is about prompt lengths, not a system prompt
    workload = base.workload.model_copy(
        update={
            "num_requests": n,
            "input_tokens": inputs,
            "output_tokens": outputs,
            "arrival": Poisson(kind="poisson", rate=rate),
        }
    )
    return base.model_copy(update={"name": name, "workload": workload, "sla": sla, "quality": None})


def short_prompts(requests: int = 400, seed: int = 0) -> Scenario:
    """Chat-sized prompts, at or below the seed's 256-token threshold; a chat's SLA."""
    chosen = _scenario(
        "short-prompts",
        Uniform(kind="uniform", low=128, high=256),
        Normal(kind="normal", mean=128, std=32, min=32, max=256),
        4.0,
        SLA(ttft_p99_ms=500, tpot_p99_ms=50),
        requests,
    )
    return chosen.model_copy(update={"workload": chosen.workload.model_copy(update={"seed": seed})})


def long_prompts(requests: int = 300, seed: int = 0) -> Scenario:
    """4,096-token prompts and 256-token answers under a tight TPOT p99 bound (35 ms) and a
    loose TTFT one (3 s)."""
    chosen = _scenario(
        "long-prompts",
        Fixed(kind="fixed", value=4096),
        Fixed(kind="fixed", value=256),
        1.0,
        SLA(ttft_p99_ms=3000, tpot_p99_ms=35),
        requests,
    )
    return chosen.model_copy(update={"workload": chosen.workload.model_copy(update={"seed": seed})})


QUANT = {"quantization": "w8a8", "kv_compression": 0.5, "max_prefill_tokens": 8192}


def caveat_grid(kind: str, chips: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each deployment's configs: a few batch sizes (and MindIE's two batch-selection modes for
    the replicas), xPyD splits sized to the prompts (a quarter to a half of the chips prefilling
    short prompts, a half to three quarters long ones), w8a8 with KV compression 0.5."""
    if kind == "short":
        batches, decode_batches, prefill_batches = (32, 64, 128), (64, 128), (4, 16)
        splits = sorted({1, chips // 4, chips // 2} - {0})
    else:
        batches, decode_batches, prefill_batches = (16, 32, 64), (64, 128), (1, 4)
        splits = sorted({chips // 2, 3 * chips // 4})
    co_located = [
        QUANT | {"deployment": "co-located", "batch_size": b, "select_batch": select}
        for b in batches
        for select in ("prefill-first", "decode-first")
    ]
    disaggregated = [
        QUANT
        | {
            "deployment": "disaggregated",
            "select_batch": "prefill-first",
            "batch_size": b,
            "prefill_instances": p,
            "decode_instances": chips - p,
            "prefill_batch_size": pb,
            "prefill_memory_share": 0.8,
            "decode_memory_share": 0.8,
        }
        for p in splits
        for b in decode_batches
        for pb in prefill_batches
    ]
    return co_located, disaggregated


def best_capacity_per_chip(
    runner: SimRunner, configs: list[dict[str, Any]], chosen: Scenario
) -> float:
    """The highest SLA-feasible output tok/s per chip over `configs` (0 when none meets it)."""
    capacities = []
    for config in configs:
        evaluation = evaluate(runner, config, chosen)
        capacity = evaluation.metrics.get("capacity_output_tokens_per_s")
        capacities.append(0.0 if evaluation.fault or capacity is None else float(capacity))
    return max(capacities)
