"""A prefill-only instance of a disaggregated deployment, lean: the same steps as
runners.sim.engine's Simulation serving requests of one output token under the prefill role's
scheduler (role_config: prefill-first, whole prompts, at most `max_prefill_batch` requests and
`max_prefill_tokens` tokens a step, within the KV blocks), without its decode machinery. A
request leaves with its prefill, so no block outlives a step but a cached prefix's
(runners.sim.prefix_cache: a prompt that starts with one computes only the rest). Its time is
the prefill stage's share of a disaggregated trial (bench/bench_disaggregation.py);
tests/test_disaggregation.py checks it against the Simulation step for step."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from runners.load.measurement import p99_breaking_count
from runners.load.workload import NO_PREFIX
from runners.sim.costs import CostModel
from runners.sim.prefix_cache import PrefixCache
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
    prefix: np.ndarray | None = None,
    cache: PrefixCache | None = None,
) -> np.ndarray | str:
    """When each prompt's prefill ends (arrivals in order), or, with a TTFT bound, why the bound
    is certainly broken: the prefill's end (plus the request latency) bounds a first token from
    below, and the prefills that end past the bound among the `judged` requests (a mask; the
    measurement's p99 samples, `samples` of them in all) break its p99."""
    planned = int(prompts.size)
    ends = np.full(planned, math.nan)
    tokens_of = prompts.tolist()
    prefix_of = [NO_PREFIX] * planned if prefix is None or cache is None else prefix.tolist()
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
        batch: list[tuple[int, int, int]] = []  # (request, its cached tokens, its own blocks)
        tokens = pairs = read = 0.0
        free = kv_blocks - (0 if cache is None else cache.resident_blocks)
        while waiting and len(batch) < seats:
            request = waiting[0]
            prompt, shared = tokens_of[request], prefix_of[request]
            cached = 0 if shared == NO_PREFIX else cache.acquire(shared)  # type: ignore[union-attr]
            need = -(-(prompt - cached + 1) // block_tokens)
            over = batch and tokens + prompt - cached > budget
            if not over and cache is not None:
                free += cache.make_room(free, need)
            if over or need > free:
                if cached:
                    cache.release(shared)  # type: ignore[union-attr]
                break
            waiting.popleft()
            free -= need
            batch.append((request, cached, need))
            tokens += prompt - cached
            pairs += prompt * (prompt + 1) / 2 - cached * (cached + 1) / 2
            read += cached
        if not batch:
            raise RuntimeError("simulation stalled: waiting requests fit nowhere")
        now += cost.step_seconds(int(tokens), pairs, int(read), len(batch), 0, 0)
        for request, cached, need in batch:
            shared = prefix_of[request]
            if cache is not None and shared != NO_PREFIX:
                if cached:  # it leaves: the prefix stays cached, idle
                    cache.release(shared)
                elif cache.can_insert(shared) and need > cache.blocks:
                    cache.insert(shared)  # its prefix's blocks outlive it, idle
                    cache.release(shared)
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
