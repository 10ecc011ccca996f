"""Runs of decode steps: most steps of a loaded engine decode and nothing else, one after
another until a request arrives that the policy would prefill. Simulation.run goes back through
its loop, the policy's choice and a step's bookkeeping for each; a run does the same steps in one
loop of its own, checking after each what run's next pass would do (admit what has arrived, then
choose), and goes on only while that is a decode step again. Its steps are those of one
_decode_step after another, to the float (tests/test_sim_speed.py replays captured studies
against the step-at-a-time code). A layer of runners.sim.engine.Simulation (on
runners.sim.arrivals)."""

from __future__ import annotations

from runners.sim.arrivals import Arrivals
from runners.sim.costs import CostModel
from runners.sim.scheduler import Scheduler, TraceStep

STALLED = "simulation stalled: waiting requests fit nowhere"


class DecodeRun(Arrivals):
    cost: CostModel
    scheduler: Scheduler
    decoding: dict[int, None]
    prefilling: dict[int, int]
    finish_heap: list[tuple[int, int, int]]
    block_heap: list[tuple[int, int, int]]
    trace: list[TraceStep] | None
    decode_steps: int
    decoding_context: int
    decode_waste: float
    finished_count: int
    decode_runs: bool  # False: one step a call, as run() would take them (the tests' reference)

    # Simulation's steps, which a run takes too: declared on the layer that calls them.
    def _grow_blocks(self) -> None:
        raise NotImplementedError

    def _retire_decoders(self) -> None:
        raise NotImplementedError

    def _chunked_step(self) -> None:
        raise NotImplementedError

    def _whole_prefill_step(self) -> None:
        raise NotImplementedError

    def _decode_steps(self, grown: bool = False) -> None:
        """Decode steps while run() would choose one after each; `grown`: the first step's
        blocks were given already (the vLLM policies grow them before they choose). Without
        a decoding request the first step is not run (run() says the simulation stalled)."""
        cost, decoding, stats = self.cost, self.decoding, self.stats
        blocks, finishes = self.block_heap, self.finish_heap
        planned = len(self.prompt)
        times, sessions = self.arrival_times, self.sessions
        # CostModel.decode_seconds, inlined: its batch's terms kept while the batch stays.
        weights, kv_per_token = cost.weight_read_bytes, cost.kv_bytes_per_token
        flops_per_s, bytes_per_s, attn = (
            cost.flops_per_s,
            cost.bytes_per_s,
            cost.attn_flops_per_pair,
        )
        batch = 0
        gemm_s = overhead_s = 0.0
        first = True
        while True:
            if not grown and blocks and blocks[0][0] <= self.decode_steps + 1:
                self._grow_blocks()
            grown = False
            if not decoding:
                if first:
                    return
                raise RuntimeError(STALLED)  # as run() would, this step running nothing
            first = False
            # Simulation._advance for a step that only decodes.
            running = len(decoding)
            if running != batch:
                batch = running
                gemm_s, overhead_s = cost.decode_terms(running)
            context = self.decoding_context
            compute = gemm_s + attn * context / flops_per_s
            memory = (weights + kv_per_token * context) / bytes_per_s
            self.now += max(compute, memory) + overhead_s + self.reload_s
            self.reload_s = 0.0
            if self.swap is not None:
                self.swaps_left = self.swap.per_step
            stats["steps"] += 1
            stats["max_running"] = max(stats["max_running"], running + len(self.prefilling))
            if self.trace is not None:
                self.trace.append(TraceStep("decode", 0, 0, running, len(self.waiting)))
            self.decode_steps += 1
            self.decoding_context += running
            if finishes and finishes[0][0] <= self.decode_steps:
                self._retire_decoders()
            # run()'s next pass: all answered, or what has arrived admitted, then the choice.
            if self.finished_count >= planned or not self.decode_runs:
                return
            if sessions is None:  # _admit_arrivals, where something is due
                arrived = self.next_arrival < planned and times is not None
                if arrived and times[self.next_arrival] <= self.now:  # type: ignore[index]
                    self._admit_arrivals()
            elif self.turn_heap and self.turn_heap[0][0] <= self.now:
                self._admit_arrivals()
            if not (self.waiting or decoding or self.prefilling) or not self._decodes_next():
                return

    def _decodes_next(self) -> bool:
        """Whether the policy's next step only decodes, where seeing so changes nothing but
        what that step would (select-batch's decode waste); False where it could be another."""
        scheduler, waiting = self.scheduler, self.waiting
        policy = scheduler.policy
        if policy == "chunked" or policy == "whole-prefill":
            # They give blocks before they choose: the next step's are given here.
            blocks = self.block_heap
            if blocks and blocks[0][0] <= self.decode_steps + 1:
                self._grow_blocks()
            if self.prefilling:
                return False
            seats = scheduler.max_batch - len(self.decoding)
            if not waiting or seats <= 0:
                return True
            self._continue_step()
            return False
        if not waiting:
            return True
        seats = min(scheduler.max_batch - len(self.decoding), scheduler.max_prefill_batch)
        if policy == "select-batch":
            running = len(self.decoding)
            idle_seats = scheduler.max_batch - running
            waste = self.decode_waste + scheduler.decode_ms_per_req * idle_seats
            if scheduler.prefill_ms_per_req * running > waste or seats <= 0:
                self.decode_waste = waste
                return True
            return False
        return seats <= 0

    def _continue_step(self) -> None:
        """The vLLM policy's step whose blocks _decodes_next gave (its own growing finds none
        due)."""
        steps = self.stats["steps"]
        if self.scheduler.policy == "chunked":
            self._chunked_step()
        else:
            self._whole_prefill_step()
        if self.stats["steps"] == steps:
            raise RuntimeError(STALLED)
