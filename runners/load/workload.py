"""Requests of a scenario's workload: lengths and arrival times, deterministic for a seed.

Shared by the simulator and the load generator so both replay the very same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from objectives.scenario import Closed, Replay, Workload
from runners.load.draws import open_arrivals, sample_lengths, with_burst
from runners.load.sessions import SessionPlan, plan_sessions
from runners.load.trace_replay import replay_arrivals, replay_chains

NO_PREFIX = -1


@dataclass(frozen=True)
class Requests:
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    # None: closed loop with `concurrency` in flight. With sessions, a later turn's time is
    # only planned: it is sent then, or a think time after its previous answer if later.
    arrival_s: np.ndarray | None
    concurrency: int | None
    # Which shared prefix each prompt starts with (NO_PREFIX: none), and its length in tokens.
    prefix: np.ndarray | None = None
    prefix_tokens: int = 0
    sessions: SessionPlan | None = None
    # With sessions, whether each request is the burst's (without, the burst's indices say).
    burst: np.ndarray | None = None
    # A trace's shared prompt blocks (runners.load.prefix_chains): each `prefix` key's tokens
    # and the shorter key it starts with, and each prompt's block ids, `block_tokens` each.
    prefix_sizes: np.ndarray | None = None
    prefix_ancestor: np.ndarray | None = None
    blocks: list[np.ndarray] | None = None
    block_tokens: int = 0

    def __len__(self) -> int:
        return int(self.input_tokens.size)

    def due_s(self, order: np.ndarray | list[int]) -> np.ndarray | None:
        """Per request of `order`, when it was due, where a runner may send it later than
        that: an open loop's session turns wait for the previous answer (runners.load.sessions).
        None where requests are sent when due (or, a closed loop, never due), and where the
        plan counts no answer time (a turn then always waits past its plan)."""
        if self.sessions is None or self.arrival_s is None or not self.sessions.paced:
            return None
        return self.arrival_s[np.asarray(order, dtype=np.int64)]

    def every(self, step: int, arrival_s: np.ndarray | None) -> Requests:
        """Every step-th request (a replica's share), with these arrival times."""
        if self.sessions is not None:  # a session is served whole by one replica
            raise ValueError("sessions are not split among replicas")
        return Requests(
            self.input_tokens[::step],
            self.output_tokens[::step],
            arrival_s,
            self.concurrency,
            None if self.prefix is None else self.prefix[::step],
            self.prefix_tokens,
            prefix_sizes=self.prefix_sizes,
            prefix_ancestor=self.prefix_ancestor,
            blocks=None if self.blocks is None else self.blocks[::step],
            block_tokens=self.block_tokens,
        )


def draw_prefixes(workload: Workload, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Which prompts start with which shared prefix, and their lengths made room for it. Its own
    random stream: a scenario's lengths and arrivals are the same with or without a prefix."""
    shared = workload.shared_prefix
    if shared is None:
        return None
    rng = np.random.default_rng([workload.seed, 1])
    n = inputs.size
    sharing = rng.random(n) < shared.share
    prefix = np.where(sharing, rng.integers(0, shared.prompts, size=n), NO_PREFIX)
    return prefix, np.where(sharing, np.maximum(inputs, shared.tokens + 1), inputs)


def make_requests(workload: Workload) -> Requests:
    if workload.trace is not None:
        return _trace_requests(workload)
    rng = np.random.default_rng(workload.seed)
    n = workload.num_requests
    inputs = sample_lengths(workload.input_tokens, n, rng)
    outputs = sample_lengths(workload.output_tokens, n, rng)
    prefix, prefix_tokens = None, 0
    drawn = draw_prefixes(workload, inputs)
    if drawn is not None:
        prefix_tokens = workload.shared_prefix.tokens  # type: ignore[union-attr]
        if workload.sessions is not None:  # only first turns open with it (plan_sessions)
            prefix = drawn[0]
        else:
            prefix, inputs = drawn
    arrival = workload.arrival
    if workload.sessions is not None:
        return _session_requests(workload, inputs, outputs, prefix, prefix_tokens)
    if isinstance(arrival, Closed):  # requests follow completions: no arrival times
        return Requests(inputs, outputs, None, arrival.concurrency, prefix, prefix_tokens)
    assert not isinstance(arrival, Replay), "a trace's requests are replay_requests'"
    arrivals = open_arrivals(arrival, n, arrival.rate, rng)
    if workload.burst is not None:
        arrivals = with_burst(arrivals, *workload.burst.indices(), workload.burst.multiple)
    return Requests(inputs, outputs, arrivals, None, prefix, prefix_tokens)


def _trace_requests(workload: Workload) -> Requests:
    """A trace's window replayed (runners.load.trace_replay), with its shared prompt blocks."""
    arrivals, inputs, outputs, order, copy = replay_arrivals(workload)
    assert workload.trace is not None, "a trace workload"
    chained = replay_chains(workload.trace, order, copy)
    if chained is None:
        return Requests(inputs, outputs, arrivals, None)
    load, blocks, size = chained
    return Requests(
        inputs,
        outputs,
        arrivals,
        None,
        load.key,
        0,
        prefix_sizes=load.tokens,
        prefix_ancestor=load.ancestor,
        blocks=blocks,
        block_tokens=size,
    )


def _session_requests(
    workload: Workload,
    inputs: np.ndarray,
    outputs: np.ndarray,
    prefix: np.ndarray | None,
    prefix_tokens: int,
) -> Requests:
    arrival = workload.arrival
    planned = plan_sessions(workload, inputs, outputs, prefix, prefix_tokens)
    return Requests(
        planned.input_tokens,
        planned.output_tokens,
        planned.planned_s,
        arrival.concurrency if isinstance(arrival, Closed) else None,
        planned.prefix,
        prefix_tokens,
        planned.plan,
        planned.burst,
    )
