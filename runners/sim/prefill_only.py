"""A prefill-only instance of a disaggregated deployment, lean: the same steps as
runners.sim.engine's Simulation serving requests of one output token under the prefill role's
scheduler (role_config: prefill-first, whole prompts, at most `max_prefill_batch` requests and
`max_prefill_tokens` tokens a step, within the KV blocks), without its decode machinery. A
request leaves with its prefill, so no block outlives a step. Its time is the prefill stage's
share of a disaggregated trial (bench/bench_disaggregation.py); tests/test_disaggregation.py
checks it against the Simulation step for step."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from runners.load.measurement import p99_breaking_count
from runners.sim.costs import CostModel
from runners.sim.scheduler import Scheduler


def prefill_ends(
    cost: CostModel,
    scheduler: Scheduler,
    prompts: np.ndarray,
    arrivals: np.ndarray,
    kv_blocks: int,
    block_tokens: int,
    ttft_bound_s: float | None = None,
    judged: np.ndarray | None = None,
    samples: int = 0,
) -> np.ndarray | str:
    """When each prompt's prefill ends (arrivals in order), or, with a TTFT bound, why the bound
    is certainly broken: the prefill's end (plus the request latency) bounds a first token from
    below, and the prefills that end past the bound among the `judged` requests (a mask; the
    measurement's p99 samples, `samples` of them in all) break its p99."""
    planned = int(prompts.size)
    ends = np.full(planned, math.nan)
    tokens_of = prompts.tolist()
    blocks_of = [-(-(tokens + 1) // block_tokens) for tokens in tokens_of]
    at = arrivals.tolist()
    seats = min(scheduler.max_batch, scheduler.max_prefill_batch)
    budget = scheduler.max_prefill_tokens
    latency_s = cost.hardware.request_latency_s
    breaking = p99_breaking_count(samples) if ttft_bound_s is not None else math.inf
    late = 0
    waiting: deque[int] = deque()
    now, arrived, done = 0.0, 0, 0
    while done < planned:
        while arrived < planned and at[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        if not waiting:
            now = max(now, at[arrived])
            continue
        batch: list[int] = []
        tokens = pairs = 0.0
        free = kv_blocks
        while waiting and len(batch) < seats:
            request = waiting[0]
            prompt = tokens_of[request]
            if (batch and tokens + prompt > budget) or blocks_of[request] > free:
                break
            waiting.popleft()
            free -= blocks_of[request]
            batch.append(request)
            tokens += prompt
            pairs += prompt * (prompt + 1) / 2
        if not batch:
            raise RuntimeError("simulation stalled: waiting requests fit nowhere")
        now += cost.step_seconds(int(tokens), pairs, 0, len(batch), 0, 0)
        for request in batch:
            ends[request] = now
            if (
                ttft_bound_s is not None
                and judged is not None
                and judged[request]
                and now + latency_s - at[request] > ttft_bound_s
            ):
                late += 1
        done += len(batch)
        if late >= breaking:
            assert ttft_bound_s is not None, "only a bound breaks"
            return (
                f"TTFT p99 bound {ttft_bound_s * 1000:g} ms certainly broken: {late} of the "
                f"{samples} measured requests after the warm-up ended their prefill after it"
            )
    return ends
