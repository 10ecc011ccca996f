"""Multi-turn sessions of a workload (objectives.scenario.Sessions): which turns make a session,
what each turn's prompt carries, and when each may be sent.

A turn's prompt is its session's history (every earlier prompt and answer) and tokens of its
own, so its input length is known before the load runs; its send time is only planned: a
session's start plus, before each turn, the previous answer as its user takes it (the wait for
its first token and a reading pace per token, objectives.scenario.Sessions) and a think time.
A runner sends a turn at its planned time, or a think time after the previous answer reached
the client if that is later: while the engine answers at the users' pace the load offers the
planned rate exactly, and once it answers slower its turns fall behind their plan, which
runners.load.measurement's delivered rate counts as backlog (due and not served). Without that
plan, turns planned as if answers were instant spilled past a short load, which then offered a
fraction of its nominal rate and met it (multi-turn-chat claimed 45 req/s and held 18).
Requests are numbered in planned order; runners sort what they measure by the real send times.

An open loop's test starts in its steady state: sessions started before it are in progress, so
turns arrive at the full rate from the first second, and not only first turns while the test is
shorter than a conversation; their histories (drawn, never sent) warm the engine before the test
as far as its memory holds them, as a running engine would hold them. Sessions keep starting to
the test's end, and those still going then are cut. The test is the first num_requests turns
from time 0. A closed loop's users each start a fresh session and take whole sessions in turn,
the last one cut to num_requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from objectives.scenario import Closed, Replay, Sessions, Workload
from runners.load.draws import inter_arrival_s, open_arrivals, sample_lengths, with_burst

FIRST_TURN = -1  # `previous` of a session's first turn in the test
# Sessions that started this many of their longest typical spans (turns - 1 think times and
# typical answers) before the test are in progress at its start: a longer session is rare (an
# exponential think time's sum passes 4 times its mean in about 1 in 10^4 sessions of 8
# turns, and answers' lengths vary less).
WARM_START_SPANS = 4
# An open loop's two sides of sessions (_Drawn), each with streams of its own (never 0: a
# stream [seed, q, 0] is [seed, q]'s, which other draws use)
FRESH, EARLIER = 1, 2


@dataclass(frozen=True)
class SessionPlan:
    session: np.ndarray  # per request, its session (numbered in the order they start)
    previous: np.ndarray  # per request, its session's previous turn (FIRST_TURN: none)
    following: np.ndarray  # per request, its session's next turn (-1: none)
    think_s: np.ndarray  # per request, the pause after the previous turn's answer (0: first)
    new_tokens: np.ndarray  # per request, the prompt tokens of its own (the rest is history)
    # per request, the history it brings from before the test (an in-progress session's first
    # turn in it; else 0): the engine is warmed with it (runners.sim.arrivals, the load
    # generator's warm-up)
    carried: np.ndarray
    firsts: np.ndarray  # each session's first turn in the test, in session order
    # an open loop's plan counts answers' time (Sessions.paces_answers): a turn is due then
    paced: bool = False

    @property
    def count(self) -> int:
        return int(self.firsts.size)


@dataclass(frozen=True)
class PlannedSessions:
    plan: SessionPlan
    input_tokens: np.ndarray  # history and new tokens
    output_tokens: np.ndarray
    # open loop: when each is due, the send times if every answer came at the users' pace
    planned_s: np.ndarray | None
    prefix: np.ndarray | None  # shared prefix of each first turn (runners.load.workload)
    burst: np.ndarray | None  # per request, whether it is planned inside the burst


def plan_sessions(
    workload: Workload,
    new_tokens: np.ndarray,
    output_tokens: np.ndarray,
    prefix: np.ndarray | None,
    prefix_tokens: int,
) -> PlannedSessions:
    """The workload's num_requests turns as requests in planned send order (the module's
    rules). A closed loop's test turns take the draws of lengths, one per request, in
    session-major order (turn after turn of session 0, then session 1, ...), and turn counts
    and think times from the sessions' own stream. An open loop's sessions draw everything
    from streams of their own (_Drawn: a turn's plan needs the previous answer's length before
    the test's turns are known, and a session keeps its draws at every rate). `prefix`: only a
    session's first turn in the test keeps its draw (session-major), lengthened as
    runners.load.workload does."""
    sessions = workload.sessions
    assert sessions is not None, "a workload with sessions"
    n = workload.num_requests
    arrival = workload.arrival
    if isinstance(arrival, Closed):
        own = _stream(workload, 2)  # its own stream: the sessions stay put
        counts = sample_lengths(sessions.turns, n, own)  # never more sessions than turns
        ends = np.cumsum(counts)
        kept = int(np.searchsorted(ends, n)) + 1
        counts = counts[:kept].copy()
        counts[-1] -= int(ends[kept - 1]) - n
        turns = _Turns(counts, _think_times(counts, sessions.think_time_s, own))
        turns.new[:], turns.out[:] = new_tokens, output_tokens
        return _as_requests(workload, turns, None, None, prefix, prefix_tokens)
    assert not isinstance(arrival, Replay), "a trace has no drawn sessions (Workload refuses it)"

    # Sessions starting in the test: never more than its turns, each starting with one.
    fresh = _Drawn(workload, n, FRESH)
    rate = arrival.rate / float(fresh.counts.mean())  # Little's law: turns come at the rate
    # the rate exact over about as many sessions as start within the test
    seen = max(2, round(n / float(fresh.counts.mean())))
    fresh.starts = open_arrivals(arrival, n, rate, fresh.stream(5), seen)
    if workload.burst is not None:  # it counts the sessions started in the test
        fresh.starts = with_burst(fresh.starts, *workload.burst.indices(), workload.burst.multiple)
    typical_turn_s = sessions.think_time_s + float(
        sessions.answer_s(np.array([round(workload.output_tokens.typical)]))[0]
    )
    warm_s = WARM_START_SPANS * (sessions.turns.bounds[1] - 1) * typical_turn_s
    count = math.ceil(warm_s * rate) + 1
    while True:  # sessions started before the test, back to warm_s before it
        earlier = _Drawn(workload, count, EARLIER)
        gaps = inter_arrival_s(arrival.model_copy(update={"rate": rate}), count, earlier.stream(5))
        earlier.starts = -np.cumsum(gaps)
        if -earlier.starts[-1] >= warm_s:
            break
        count *= 2
    turns, starts = _Drawn.joined(earlier, fresh)
    at = turns.times(starts, sessions)
    in_test = np.flatnonzero(at >= 0)
    test = np.zeros(at.size, bool)
    test[in_test[np.argsort(at[in_test], kind="stable")[:n]]] = True
    history = turns.history()  # of the turns before the test: what a session carries in
    burst_window = None
    if workload.burst is not None:
        first, end = workload.burst.indices()
        burst_window = (fresh.starts[first], fresh.starts[end - 1])
    return _as_requests(
        workload, turns.only(test, history), at[test], burst_window, prefix, prefix_tokens
    )


class _Drawn:
    """Sessions of an open loop drawn outward from the test's start, so that each keeps its
    draws whatever the rate (a capacity search's steps hold the same conversations): those
    starting in it (FRESH) in start order, those started before it (EARLIER) latest first,
    each side from streams of its own, one per quantity. Per session its turns, start and,
    per turn (session-major), think time, new tokens and answer tokens."""

    def __init__(self, workload: Workload, count: int, side: int):
        sessions = workload.sessions
        assert sessions is not None, "a workload with sessions"
        self.workload, self.side = workload, side
        self.counts = sample_lengths(sessions.turns, count, self.stream(2))
        total = int(self.counts.sum())
        self.think = (
            self.stream(6).exponential(sessions.think_time_s, total)
            if sessions.think_time_s
            else np.zeros(total)
        )
        self.new = sample_lengths(workload.input_tokens, total, self.stream(3))
        self.out = sample_lengths(workload.output_tokens, total, self.stream(4))
        self.starts = np.zeros(count)  # set by plan_sessions

    def stream(self, quantity: int) -> np.random.Generator:
        return _stream(self.workload, quantity, self.side)

    @staticmethod
    def joined(earlier: _Drawn, fresh: _Drawn) -> tuple[_Turns, np.ndarray]:
        """Both sides as one set of sessions in start order, and their starts."""
        counts = earlier.counts[::-1]
        firsts = np.cumsum(earlier.counts) - earlier.counts  # in earlier's own order
        # each reversed session's turns, still in turn order
        order = np.repeat(firsts[::-1] - (np.cumsum(counts) - counts), counts) + np.arange(
            int(counts.sum())
        )
        all_counts = np.concatenate([counts, fresh.counts])
        think = np.concatenate([earlier.think[order], fresh.think])
        think[np.cumsum(all_counts) - all_counts] = 0.0  # none before a first turn
        turns = _Turns(all_counts, think)
        turns.new = np.concatenate([earlier.new[order], fresh.new])
        turns.out = np.concatenate([earlier.out[order], fresh.out])
        return turns, np.concatenate([earlier.starts[::-1], fresh.starts])


class _Turns:
    """Every turn of the sessions drawn, session-major."""

    def __init__(self, counts: np.ndarray, think: np.ndarray, history: np.ndarray | None = None):
        self.counts = counts
        self.session = np.repeat(np.arange(counts.size), counts)
        self.first_of = np.cumsum(counts) - counts  # each session's first turn
        self.think = think
        self.new = np.zeros(think.size, np.int64)
        self.out = np.zeros(think.size, np.int64)
        self.carried = np.zeros(think.size, np.int64) if history is None else history

    def times(self, starts: np.ndarray, sessions: Sessions) -> np.ndarray:
        """Per turn, when it is planned: its session's start and, before it, each earlier
        turn's answer as its user takes it and the think time."""
        answered = np.zeros(self.think.size)
        answered[1:] = sessions.answer_s(self.out[:-1])
        answered[self.first_of] = 0.0
        waited = np.cumsum(self.think + answered)
        return starts[self.session] + (waited - waited[self.first_of][self.session])

    def history(self) -> np.ndarray:
        """Per turn, the tokens of its session's earlier prompts and answers."""
        whole = self.new + self.out
        done = np.cumsum(whole) - whole
        return done - done[self.first_of][self.session]

    def only(self, kept: np.ndarray, history: np.ndarray) -> _Turns:
        """The kept turns (a run of each session's), renumbered, with their history."""
        counts = np.bincount(self.session[kept], minlength=self.counts.size)
        turns = _Turns(counts[counts > 0], self.think[kept], history[kept])
        turns.new, turns.out = self.new[kept], self.out[kept]
        return turns


def _stream(workload: Workload, *purpose: int) -> np.random.Generator:
    return np.random.default_rng([workload.seed, *purpose])


def _think_times(counts: np.ndarray, mean_s: float, rng: np.random.Generator) -> np.ndarray:
    """Session-major: the pause before each turn (none before a first)."""
    total = int(counts.sum())
    think = rng.exponential(mean_s, total) if mean_s else np.zeros(total)
    think[np.cumsum(counts) - counts] = 0.0
    return think


def _as_requests(
    workload: Workload,
    turns: _Turns,
    planned: np.ndarray | None,
    burst_window: tuple[float, float] | None,
    prefix: np.ndarray | None,
    prefix_tokens: int,
) -> PlannedSessions:
    n = int(turns.counts.sum())
    first = np.zeros(n, bool)
    first[turns.first_of] = True
    carried = turns.carried[turns.first_of][turns.session]  # history from before the test
    new = turns.new
    if prefix is not None:
        # A session in progress brings its shared prompt inside its history (warmed as one).
        prefix = np.where(first & (carried == 0), prefix, -1)
        # the prompt's start (history and all) is the prefix and at least one token more
        new = np.where(prefix >= 0, np.maximum(new, prefix_tokens + 1), new)
    whole = new + turns.out
    done = np.cumsum(whole) - whole
    inputs = carried + done - done[turns.first_of][turns.session] + new

    order = np.arange(n) if planned is None else np.argsort(planned, kind="stable")
    burst = None
    if planned is not None and burst_window is not None:
        burst = (planned >= burst_window[0]) & (planned <= burst_window[1])
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    positions = np.arange(n)
    previous = np.where(first, FIRST_TURN, rank[np.maximum(positions - 1, 0)])
    last = np.zeros(n, bool)
    last[np.cumsum(turns.counts) - 1] = True
    following = np.where(last, -1, rank[np.minimum(positions + 1, n - 1)])
    plan = SessionPlan(
        session=turns.session[order],
        previous=previous[order],
        following=following[order],
        think_s=turns.think[order],
        new_tokens=new[order],
        carried=np.where(first, carried, 0)[order],
        firsts=rank[turns.first_of],
        paced=planned is not None and workload.sessions.paces_answers,  # type: ignore[union-attr]
    )
    return PlannedSessions(
        plan,
        inputs[order],
        turns.out[order],
        None if planned is None else planned[order],
        None if prefix is None else prefix[order],
        None if burst is None else burst[order],
    )
