"""A disaggregated deployment in the simulator: prefill instances, KV transfers, decode instances.

The router sends request i to prefill instance i mod P and to decode instance i mod D (in
turn, in arrival order, as vLLM's disaggregated-serving proxy toy_proxy_server.py does;
MindIE's coordinator balances by load, which is not modelled).
1. Each prefill instance runs a prefill-only engine: a request leaves it after its prefill (as
   vLLM's proxy sends it: max_tokens 1), giving back its KV blocks then (the transfer's own
   hold on them is not modelled).
2. Its KV cache (prompt tokens x the model's KV bytes per token at the trial's KV compression)
   leaves over the prefill chip's link, one transfer after another: the link's set-up latency
   plus bytes / bandwidth; the link within a node when the deployment fits in one, else the
   link between nodes. Layer-by-layer transfer overlapping the prefill is not modelled.
3. Each decode instance takes requests as their KV arrives, decode-only: a request joins the
   running batch when it has a seat and KV blocks for its context, and decodes a token a step.
The first token reaches the client once a decode instance has taken the request over: with
MindIE the prefill instance's token, sent when the decode instance pulls the KV cache (a seat
and blocks free); with vLLM, which streams every token from the decode instance, at the end of
the request's first decode step there. Either way a saturated decode pool shows in TTFT, as it
does on the engines, where the KV cache waits on the prefill chip until it is pulled.
The stages run one after another: a prefill instance never waits for a decode instance (the
decode instance's queue holds the KV that arrived), which is exact under open-loop arrivals. A
closed loop couples them through the client: SimRunner refuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from objectives.scenario import SLA, Workload
from runners.load.measurement import Fault, Measurement, p99_breaking_count, warmup_requests
from runners.load.workload import Requests, make_requests
from runners.sim.costs import CostModel
from runners.sim.engine import Simulation
from runners.sim.prefill_only import prefill_ends
from runners.sim.prefix_cache import PrefixCache
from runners.sim.profiles import LinkFigures
from runners.sim.router import fleet_window
from runners.sim.scheduler import Scheduler
from search_spaces.deployment import Roles

# Where a client's first token comes from, per engine (module docstring).
FIRST_TOKEN_FROM = {"mindie": "prefill", "vllm": "decode"}


class DecodeOnly(Simulation):
    """Requests arrive with their prompt's KV cache: they join the running batch as seats and
    blocks allow, and decode; the instance runs no prefill step. Each request's first output
    token is taken at joining, costing no step (the caller adds one for vLLM, whose first token
    ends the first decode step).

    Early rejection judges the measured requests only: a first token counts late against when
    the client sent the request (`sent_s`), if `judged` (a mask: the measurement's p99 samples,
    its warm-up left out) says so, over `samples` p99 samples of the measurement, `known_late`
    of them known late already."""

    def __init__(
        self,
        cost: CostModel,
        scheduler: Scheduler,
        requests: Requests,
        kv_blocks: int,
        block_tokens: int,
        ttft_bound_s: float | None = None,
        sent_s: np.ndarray | None = None,
        judged: np.ndarray | None = None,
        samples: int = 0,
        known_late: int = 0,
    ):
        super().__init__(cost, scheduler, requests, kv_blocks, block_tokens, ttft_bound_s)
        self.first_step_end = [math.nan] * len(self.prompt)
        self.sent_s = sent_s
        self.judged = judged
        if self.ttft_bound_s is not None:
            self.warmup = 0  # `judged` decides instead of the arrival order here
            self.breaking_count = p99_breaking_count(samples)
            self.late_first_tokens = known_late

    def _arrive(self, request: int, send_s: float) -> None:
        super()._arrive(request, send_s)
        if self.sent_s is not None:  # TTFT counts from the client's send, not the KV's arrival
            self.send[request] = float(self.sent_s[request])

    def _first_token(self, request: int) -> None:
        late = self.late_first_tokens
        super()._first_token(request)
        if self.judged is not None and not self.judged[request]:
            self.late_first_tokens = late

    def _step(self) -> None:
        self._grow_blocks()
        seats = self.scheduler.max_batch - len(self.decoding)
        joined = self._pick_prefills(math.inf, seats, seats)
        # A request preempted here lost its KV cache: the instance recomputes it (its prompt
        # and what it generated) in a prefill step of its own, as the engines do.
        again = [request for request in joined if not math.isnan(self.first[request])]
        if again:
            tokens = sum(self.prompt[request] for request in again)
            pairs = sum(self.prompt[r] * (self.prompt[r] + 1) / 2 for r in again)
            seconds = self.cost.step_seconds(tokens, pairs, 0, len(again), 0, 0)
            self._advance(seconds, False, len(again), tokens)
        for request in joined:
            self._first_token(request)
        self._decode_step()
        for request in joined:
            # A preempted request that joins again has had its first token already.
            if math.isnan(self.first_step_end[request]):
                self.first_step_end[request] = self.now


@dataclass(frozen=True)
class Fleet:
    """One disaggregated config: each role's cost model, scheduler and KV blocks."""

    roles: Roles
    prefill_cost: CostModel
    prefill_scheduler: Scheduler
    prefill_blocks: int
    decode_cost: CostModel
    decode_scheduler: Scheduler
    decode_blocks: int
    block_tokens: int
    link: LinkFigures
    first_token_from: str  # "prefill" or "decode"
    # Each prefill instance keeps the shared prefixes it computed; a decode instance receives
    # every prompt's whole KV cache.
    prefix_caching: bool = False


class DisaggregatedSession:
    """The deployment under a per-chip load: every prefill instance, and one decode instance
    standing for all (round-robin gives each decode instance an alike stream, as for
    co-located replicas). The deployment is loaded for as long as a co-located replica's window
    lasts (`num_requests` per chip at the per-chip rate), so the two measure alike spans; the
    requests that decode instance serves are the measurement, on its share of the chips."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.extra: dict[str, Any] = {}

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        chips = self.fleet.roles.chips
        requests = make_requests(fleet_window(workload, chips))
        assert requests.arrival_s is not None, "SimRunner refuses closed loops disaggregated"
        bound = sla.ttft_p99_ms / 1000 if sla is not None and stop_early else None
        try:
            return self._run(requests, requests.arrival_s, bound)
        except RuntimeError as error:
            return Measurement.failed(Fault("error", f"simulator: {error}"))

    def _run(
        self, requests: Requests, arrivals: np.ndarray, ttft_bound_s: float | None
    ) -> Measurement:
        fleet = self.fleet
        prefills, decodes = fleet.roles.prefill, fleet.roles.decode
        n = len(requests)
        measured = np.arange(0, n, decodes)  # decode instance 0's requests
        sent = arrivals[measured]
        latency_s = fleet.decode_cost.hardware.request_latency_s
        out = requests.output_tokens[measured]
        warmup = np.arange(measured.size) < warmup_requests(measured.size)
        judged: np.ndarray = np.zeros(n, bool)  # the measurement's p99 samples
        judged[measured[~warmup]] = True
        samples = int(judged.sum())
        prefill_done = np.full(n, math.nan)
        ready = np.full(n, math.nan)
        # Only the prefill instances that feed decode instance 0 (with round-robin on both, those
        # whose number is a multiple of gcd(prefills, decodes)).
        for instance in np.unique(measured % prefills):
            mine = np.arange(instance, n, prefills)
            cache = None
            if fleet.prefix_caching and requests.prefix_tokens:
                cache = PrefixCache(requests.prefix_tokens, fleet.block_tokens)
            # No first token before the prefill ends: early rejection there too.
            ends = prefill_ends(
                fleet.prefill_cost,
                fleet.prefill_scheduler,
                requests.input_tokens[mine],
                arrivals[mine],
                fleet.prefill_blocks,
                fleet.block_tokens,
                ttft_bound_s,
                judged[mine],
                samples,
                None if requests.prefix is None else requests.prefix[mine],
                cache,
            )
            if isinstance(ends, str):
                return self._rejected(requests, measured, ends)
            prefill_done[mine] = ends
            ready[mine] = self._transfers(requests.input_tokens[mine], prefill_done[mine])
        from_decode = fleet.first_token_from == "decode"
        # MindIE: a one-token answer ended with its prefill; the rest join with the prefill's
        # token. vLLM: one token more, so that every answered token costs a decode step and
        # the first ends the request's first step.
        done_at_prefill = out == 1 if not from_decode else np.zeros(out.size, bool)
        if ttft_bound_s is not None:
            # No first token before the KV cache arrives (a one-token answer's: its prefill
            # ends): early rejection once that alone breaks the TTFT p99 bound.
            earliest = np.where(done_at_prefill, prefill_done[measured], ready[measured])
            rejected = _certainly_late(earliest + latency_s - sent, ttft_bound_s)
            if rejected is not None:
                return self._rejected(requests, measured, rejected)
        first = prefill_done[measured].copy()
        finish = np.full(measured.size, math.nan)
        decoded = np.flatnonzero(~done_at_prefill)
        finish[done_at_prefill] = first[done_at_prefill]
        order = decoded[np.argsort(ready[measured][decoded], kind="stable")]
        early_late = (first + latency_s - sent > (ttft_bound_s or math.inf)) & ~warmup
        sim = DecodeOnly(
            fleet.decode_cost,
            fleet.decode_scheduler,
            Requests(
                requests.input_tokens[measured][order],
                out[order] + 1 if from_decode else out[order],
                ready[measured][order],
                None,
            ),
            fleet.decode_blocks,
            fleet.block_tokens,
            ttft_bound_s,  # Simulation adds the request latency itself
            sent_s=sent[order],
            judged=~warmup[order],
            samples=samples,
            known_late=int((early_late & done_at_prefill).sum()),
        )
        decoding = sim.run()
        if decoding.fault is not None:
            return self._rejected(requests, measured, decoding.fault.message)
        finish[order] = sim.finish
        first[order] = sim.first_step_end if from_decode else np.array(sim.first)
        transfer_ms = (ready[measured] - prefill_done[measured]) * 1000
        return Measurement(
            send_s=sent,
            first_token_s=first + latency_s,
            finish_s=finish + latency_s,
            input_tokens=requests.input_tokens[measured],
            output_tokens=out,
            ok=~np.isnan(finish),
            peak_kv_usage=sim.peak_used / sim.total_blocks,
            warmup=warmup_requests(measured.size),
            chips=fleet.roles.chips / decodes,
            extra={
                "kv_link": fleet.link.kind,
                "kv_transfer_p50_ms": float(np.percentile(transfer_ms, 50)),
                "kv_transfer_p99_ms": float(np.percentile(transfer_ms, 99)),
                "decode_preemptions": sim.stats["preemptions"],
            },
        )

    def _rejected(self, requests: Requests, measured: np.ndarray, why: str) -> Measurement:
        """Stopped early: the TTFT p99 bound is certainly broken (nothing counts as served)."""
        fleet = self.fleet
        assert requests.arrival_s is not None
        return Measurement(
            send_s=requests.arrival_s[measured],
            first_token_s=np.full(measured.size, math.nan),
            finish_s=np.full(measured.size, math.nan),
            input_tokens=requests.input_tokens[measured],
            output_tokens=requests.output_tokens[measured],
            ok=np.zeros(measured.size, bool),
            warmup=warmup_requests(measured.size),
            chips=fleet.roles.chips / fleet.roles.decode,
            fault=Fault("sla-violated", why),
        )

    def _transfers(self, prompt_tokens: np.ndarray, prefill_done: np.ndarray) -> np.ndarray:
        """When each of one prefill chip's requests has its KV cache on its decode instance:
        the chip sends one transfer after another over its link, in the order prefills end.
        With S the running sum of transfer times in that order, transfer k ends at
        S_k + max over j <= k of (done_j - S_(j-1)): after the latest prefill end that the
        transfers queued behind it had to wait for."""
        link = self.fleet.link
        seconds = (
            link.latency_ms.value / 1000
            + prompt_tokens * self.fleet.prefill_cost.kv_bytes_per_token
            / (link.bandwidth_gbs.value * 1e9)
        )  # fmt: skip
        order = np.argsort(prefill_done, kind="stable")
        total = np.cumsum(seconds[order])
        ends = total + np.maximum.accumulate(prefill_done[order] - (total - seconds[order]))
        ready = np.empty_like(prefill_done)
        ready[order] = ends
        return ready


def _certainly_late(earliest_ttft_s: np.ndarray, bound_s: float) -> str | None:
    """Why the TTFT p99 bound is certainly broken when no request's TTFT can be below
    `earliest_ttft_s` (its KV cache's arrival); None when it may still hold."""
    after_warmup = earliest_ttft_s[warmup_requests(earliest_ttft_s.size) :]
    late = int(np.sum(after_warmup > bound_s))
    if late < p99_breaking_count(after_warmup.size):
        return None
    return (
        f"TTFT p99 bound {bound_s * 1000:g} ms certainly broken: {late} of the "
        f"{after_warmup.size} requests after the warm-up had their KV cache on the decode "
        "instance only after it"
    )
