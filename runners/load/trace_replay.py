"""A trace workload's requests (objectives.trace): the window's arrivals scaled to the
workload's rate, its lengths as read.

A load of more requests than the window holds replays the window again after its span (a
hold's long horizon is the same traffic, end to end), each copy's conversations and prompt
blocks its own: a copy is new traffic of the same shape, not the same prompts sent twice. A
fresh draw (the workload's seed, `at_rate`'s seed offset) starts the window at another of its
requests and wraps around: the same traffic, its busy and quiet stretches met at other points
of the load. Seed 0 is the trace as written.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from objectives.scenario import Workload
from objectives.trace import Trace, TraceWindow
from objectives.trace_formats import read_window
from runners.load.prefix_chains import PrefixChains, chain_keys, session_blocks

# A conversation's history is shared in blocks this long where the trace names no blocks of its
# own: vLLM's default KV block (a coarser one would hide up to a block of each hit).
SESSION_BLOCK_TOKENS = 16

# Where seed k starts the window: k times the golden ratio's fraction of its requests, modulo
# them (successive seeds spread evenly over the window, none twice).
_GOLDEN = (5**0.5 - 1) / 2


def replay_order(count: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of the window's `count` requests each of a load's `n` is, and which copy of the
    window it belongs to."""
    start = int(count * ((seed * _GOLDEN) % 1.0)) if seed else 0
    position = start + np.arange(n, dtype=np.int64)
    return position % count, position // count


def replay_arrivals(workload: Workload) -> tuple[np.ndarray, ...]:
    """The load's arrival times (from 0, at the workload's rate), prompt and output lengths,
    and each request's place in the window and copy of it (replay_order)."""
    trace = workload.trace
    assert trace is not None, "a trace workload"
    window = read_window(trace)
    order, copy = replay_order(len(window), workload.num_requests, workload.seed)
    at_s = window.arrival_s[order] + copy * window.span_s
    at_s = at_s - at_s[0]
    # the trace's own rate -> the workload's: its gaps shrink by the multiple
    at_s = at_s * (window.rate / workload.arrival.rate)  # type: ignore[union-attr]
    return at_s, window.input_tokens[order], window.output_tokens[order], order, copy


def _window_blocks(trace: Trace, window: TraceWindow) -> tuple[list[np.ndarray] | None, int]:
    """The window's prompt blocks and their size: the trace's own, else its conversations'."""
    if window.blocks is not None:
        return window.blocks, window.block_tokens
    if window.session is not None:
        size = trace.block_tokens or SESSION_BLOCK_TOKENS
        return session_blocks(window.session, window.input_tokens, window.output_tokens, size), size
    return None, 0


@lru_cache(maxsize=8)
def _window_chains(trace: Trace) -> tuple[PrefixChains, list[np.ndarray], int] | None:
    window = read_window(trace)
    blocks, size = _window_blocks(trace, window)
    if blocks is None:
        return None
    return chain_keys(blocks, window.input_tokens, size), blocks, size


def window_chains(trace: Trace) -> PrefixChains:
    """The prefix keys of the trace's window as read (one replay)."""
    chained = _window_chains(trace)
    assert chained is not None, "a trace whose prompts share blocks"
    return chained[0]


def replay_chains(
    trace: Trace, order: np.ndarray, copy: np.ndarray
) -> tuple[PrefixChains, list, int] | None:
    """Where the trace's prompts share blocks: the prefix keys (runners.load.prefix_chains)
    of a load replaying the window's requests `order` in `copy` (replay_arrivals), its
    prompts' block ids and their size, each replay of the window with ids of its own (None:
    they share none)."""
    chained = _window_chains(trace)
    if chained is None:
        return None
    chains, blocks, size = chained
    span = 1 + max((int(b.max()) for b in blocks if b.size), default=0)
    ids = [blocks[i] + c * span for i, c in zip(order.tolist(), copy.tolist(), strict=True)]
    return chains.tiled(copy, order), ids, size
