"""How requests reach the engine simulation: an open loop's at their arrival times, a closed
loop's as earlier ones finish, and a workload's sessions (runners.load.sessions): a session's first
turn when it starts (an open loop) or when a user is free (a closed loop of users), each later
turn a think time after the previous answer reached the client (an open loop's not before its
planned time, runners.load.sessions), and with a prefix cache the session's history kept as a
cached prefix between its turns, where the next turn finds it if memory did not need it
meanwhile. A layer of runners.sim.engine.Simulation (on runners.sim.admission).

A session in progress when the test starts brings its history, warmed into the cache before it
as memory allows (runners.load.sessions). A session's history is held as one cache entry: the
whole blocks of its last turn's prompt and answer, less those of the shared prompt it opened
with (held once, by that prompt's entry, as vLLM's chained block hashes share them, and kept
resident while the history is: without it the history could not be hit). Between
turns the entry is idle, the least recently used evicted first (to the host tier where there is
one): the seed's cold requests.
"""

from __future__ import annotations

import heapq

import numpy as np

from runners.load.sessions import SessionPlan
from runners.sim.admission import Admission


def session_key(session: int) -> int:
    """A session's history in the prefix cache (shared prefixes are 0, 1, ...)."""
    return -2 - session


class Arrivals(Admission):
    sessions: SessionPlan | None
    arrivals: np.ndarray | None
    arrival_times: list[float] | None  # the same, as Python floats: read on every step
    concurrency: int | None
    next_arrival: int
    sent_rank: list[int]
    sent_count: int
    turn_heap: list[tuple[float, int]]
    next_session: int
    send: list[float]
    input_tokens: np.ndarray
    output_tokens: list[int]
    latency_s: float
    now: float

    def _arrive(self, request: int, send_s: float) -> None:
        self._sent(request, send_s)
        self.next_arrival += 1

    def _sent(self, request: int, send_s: float) -> None:
        self.send[request] = send_s
        self.sent_rank[request] = self.sent_count
        self.sent_count += 1
        self.waiting.append(request)

    def _admit_arrivals(self) -> None:
        if self.sessions is not None:
            self._admit_turns()
            return
        planned = len(self.prompt)
        arrivals = self.arrival_times
        if arrivals is None:
            if self.next_arrival == 0:
                if self.concurrency is None:  # make_requests gives one or the other
                    raise ValueError("requests without arrival times need a concurrency")
                for i in range(min(self.concurrency, planned)):
                    self._arrive(i, 0.0)
            return
        while self.next_arrival < planned and arrivals[self.next_arrival] <= self.now:
            self._arrive(self.next_arrival, arrivals[self.next_arrival])

    def _next_arrival_s(self) -> float:
        if self.sessions is not None and self.turn_heap:
            return self.turn_heap[0][0]
        if self.sessions is not None or self.arrivals is None:
            raise RuntimeError("simulation stalled: nothing in flight and nothing to send")
        return float(self.arrivals[self.next_arrival])

    def _answered(self, request: int) -> None:
        """The request's answer is complete: a closed loop sends its next request."""
        if self.sessions is not None:
            self._next_turn(request)
        elif self.arrivals is None and self.next_arrival < len(self.prompt):
            self._arrive(self.next_arrival, self.now)

    def _plan_turns(self, arrival_s: np.ndarray | None, concurrency: int | None) -> None:
        plan = self.sessions
        assert plan is not None, "a workload with sessions"
        self.turn_heap = []
        for request in np.flatnonzero((plan.previous >= 0) | (plan.carried > 0)):
            # a later turn looks its session's history up in the cache
            self.prefix[request] = session_key(int(plan.session[request]))
        self._warm(arrival_s)
        if arrival_s is not None:
            self.turn_heap = [(float(arrival_s[first]), int(first)) for first in plan.firsts]
            heapq.heapify(self.turn_heap)
            self.next_session = plan.count
        else:  # a closed loop: `concurrency` users, each starting its next session at once
            assert concurrency is not None, "a closed loop has a concurrency"
            users = min(concurrency, plan.count)
            self.turn_heap = [(0.0, int(first)) for first in plan.firsts[:users]]
            self.next_session = users

    def _warm(self, arrival_s: np.ndarray | None) -> None:
        """The histories that sessions in progress bring into the test, cached as a running
        engine would hold them: idle, as far as the free blocks go, the next to be needed the
        most recently used."""
        plan, cache = self.sessions, self.prefix_cache
        assert plan is not None, "a workload with sessions"
        if cache is None or arrival_s is None:
            return
        bringing = np.flatnonzero(plan.carried > 0)
        kept: list[tuple[int, int]] = []
        for request in bringing[np.argsort(arrival_s[bringing], kind="stable")]:
            blocks = int(plan.carried[request]) // self.block_tokens
            if 0 < blocks <= self.free_blocks:  # the soonest needed first
                self.free_blocks -= blocks
                kept.append((int(request), blocks))
        for request, blocks in reversed(kept):  # and the most recently used
            key = session_key(int(plan.session[request]))
            cache.insert(key, blocks, blocks * self.block_tokens, in_use=False)

    def _admit_turns(self) -> None:
        heap = self.turn_heap
        while heap and heap[0][0] <= self.now:
            send_s, request = heapq.heappop(heap)
            self._sent(request, send_s)

    def _next_turn(self, request: int) -> None:
        """The request's answer is complete: its session's next turn (or, a closed loop's user
        being free, the next session) is due when the client has it and has thought."""
        plan = self.sessions
        assert plan is not None, "a workload with sessions"
        answered = self.now + self.latency_s
        following = int(plan.following[request])
        if following >= 0:
            self._keep_history(request)
            due = answered + float(plan.think_s[following])
            if self.arrivals is not None:  # an open loop's turn waits for its planned time
                due = max(due, float(self.arrivals[following]))
            heapq.heappush(self.turn_heap, (due, following))
        elif self.next_session < plan.count:
            heapq.heappush(self.turn_heap, (self.now, int(plan.firsts[self.next_session])))
            self.next_session += 1

    def _keep_history(self, request: int) -> None:
        """Hand the whole blocks of the finished turn's context to the cache as its session's
        history (they leave the request's own blocks)."""
        cache = self.prefix_cache
        if cache is None:
            return
        plan = self.sessions
        assert plan is not None, "a workload with sessions"
        key = session_key(int(plan.session[request]))
        context = int(self.input_tokens[request]) + self.output_tokens[request]
        whole = context // self.block_tokens
        held = self.cached[request] // self.block_tokens  # blocks another entry holds for it
        moved = min(max(whole - held, 0), self.blocks[request])
        if self.prefix[request] == key and self.cached[request]:
            cache.grow(key, moved, whole * self.block_tokens)
        elif moved and key not in cache.users:
            # It extends the shared prompt it found cached, which it keeps resident.
            opened_with = self.prefix[request] if held else None
            cache.insert(key, moved, whole * self.block_tokens, in_use=False, parent=opened_with)
        else:
            return
        self.blocks[request] -= moved

    def _sent_order(self) -> np.ndarray:
        """The requests sent so far, in the order they were sent."""
        send = np.array(self.send)
        sent = np.flatnonzero(~np.isnan(send))
        return sent[np.argsort(send[sent], kind="stable")]
