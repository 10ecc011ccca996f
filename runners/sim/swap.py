"""Preemption by swap, as MindIE does it (ScheduleConfig.maxPreemptCount, ModelConfig
cpuMemSize): a running request preempted for lack of KV blocks copies its blocks to a swap pool
in host memory, up to `per_step` requests a scheduling round and while the pool has room;
readmitted, it copies them back and goes on decoding, where a request preempted by recompute
(vLLM V1's only mode, MindIE's beyond that budget) computes its prompt and every token it
generated again. Both copies wait on the host link: swapping beats recomputing on a fast link
and for long contexts, and loses on a slow one (search_spaces/memory-options.md, section 3).

The first layer of runners.sim.engine.Simulation. A request swapped back rejoins through the prefill
path with all but one token of its context restored, so its step computes that one token (the
step it would have decoded), over its whole context."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapSpace:
    blocks: int  # blocks the host pool holds (cpuMemSize)
    block_seconds: float  # one block over the host link, each way
    latency_s: float  # per copy
    block_bytes: float
    per_step: int  # requests swapped out a scheduling round at most (maxPreemptCount)


class Swapping:
    swap: SwapSpace | None
    swapped: dict[int, int]  # request -> blocks in the swap pool
    swap_used: int
    swaps_left: int
    restored: list[int]  # per request, context tokens brought back by a swap (not computed)
    reload_s: float
    blocks: list[int]
    cached: list[int]
    prompt: list[int]
    block_tokens: int
    stats: dict[str, int]

    def _init_swap(self, swap: SwapSpace | None, planned: int) -> None:
        self.swap = swap
        self.swapped = {}
        self.swap_used = 0
        self.swaps_left = 0 if swap is None else swap.per_step
        self.restored = [0] * planned
        if swap is not None:
            self.stats |= {"swaps_out": 0, "swaps_in": 0, "kv_swapped_out_mb": 0}

    def _swap_out(self, request: int) -> bool:
        """Swap a preempted decoding request's context out, where the round's budget and the
        pool allow: whether it was (its device blocks are then the caller's to free)."""
        swap = self.swap
        if swap is None or self.swaps_left == 0:
            return False
        moved = self.blocks[request] + self.cached[request] // self.block_tokens
        if self.swap_used + moved > swap.blocks:
            return False
        self.swaps_left -= 1
        self.swap_used += moved
        self.swapped[request] = moved
        self.reload_s += self._copy_seconds(moved)
        self.stats["swaps_out"] += 1
        self.stats["kv_swapped_out_mb"] += round(moved * swap.block_bytes / 1e6)
        return True

    def _swap_back(self, request: int) -> float:
        """A swapped request admitted again gets all but one token of its context back: the
        seconds the copy takes (its pool blocks are freed)."""
        moved = self.swapped.pop(request)
        self.swap_used -= moved
        self.stats["swaps_in"] += 1
        self.restored[request] = self.prompt[request] - 1
        return self._copy_seconds(moved)

    def _copy_seconds(self, blocks: int) -> float:
        assert self.swap is not None, "only a swap pool copies"
        return self.swap.latency_s + blocks * self.swap.block_seconds

    def _new_round(self) -> None:
        if self.swap is not None:
            self.swaps_left = self.swap.per_step
