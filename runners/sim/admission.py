"""How the engine simulation admits waiting requests: the prompts a step takes within its token
budget, seats and free KV blocks, and through a prefix cache (runners.sim.prefix_cache) what
each finds cached, on the device or in the host tier, what it computes, and the blocks it
hands to the cache. A layer of runners.sim.engine.Simulation (on runners.sim.swap)."""

from __future__ import annotations

from collections import deque

from runners.load.workload import NO_PREFIX
from runners.sim.prefix_cache import PrefixCache
from runners.sim.swap import Swapping


class Admission(Swapping):
    waiting: deque[int]
    prefix_cache: PrefixCache | None
    prefix: list[int]
    deeper: list[int]  # a trace's key, where the request holds only a shorter one (`prefix`)
    free_blocks: int
    total_blocks: int
    peak_used: int

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _take(self, blocks: int) -> None:
        self.free_blocks -= blocks
        # Cached blocks no request uses are free to take back (as vLLM counts its KV usage).
        idle = 0 if self.prefix_cache is None else self.prefix_cache.idle_blocks
        self.peak_used = max(self.peak_used, self.total_blocks - self.free_blocks - idle)

    def _free_up(self, blocks: int) -> bool:
        """Make `blocks` free, evicting idle cached prefixes where that is enough; whether
        they are."""
        if self.free_blocks >= blocks:  # make_room would evict nothing
            return True
        if self.prefix_cache is not None:
            self.free_blocks += self.prefix_cache.make_room(self.free_blocks, blocks)
        return self.free_blocks >= blocks

    def _acquire_prefix(self, request: int) -> tuple[int, float | None]:
        """The prompt tokens an admitted request finds cached, and the seconds to reload them
        from the host tier (None: found on the device, or not at all). A prompt computes its
        last token at least, as vLLM's block cache leaves the block that holds it to compute (a
        trace's key can be a whole prompt of one of its users)."""
        cache, prefix = self.prefix_cache, self.prefix[request]
        if cache is None or prefix == NO_PREFIX:
            return 0, None
        most = (self.prompt[request] - 1) // self.block_tokens * self.block_tokens
        self.cached[request] = min(cache.acquire(prefix), most)
        if self.cached[request]:
            return self.cached[request], None
        reload_s = cache.reload_seconds(prefix)
        if reload_s is not None:
            return min(cache.host[prefix].tokens, most), reload_s
        start = cache.resident_start(prefix)
        if start >= 0:  # a trace's key found in part: it holds that part and computes on
            self.deeper[request] = prefix
            self.prefix[request] = start
            self.cached[request] = min(cache.acquire(start), most)
        return self.cached[request], None

    def _release_prefix(self, request: int) -> None:
        if self.cached[request]:
            self.prefix_cache.release(self.prefix[request])  # type: ignore[union-attr]
            self.cached[request] = 0
        if self.deeper[request] != NO_PREFIX:  # it looks its own key up again next time
            self.prefix[request], self.deeper[request] = self.deeper[request], NO_PREFIX

    def _cache_prefix(self, request: int) -> None:
        """A request that computed its shared prefix hands those blocks to the cache (a
        session's history is handed over when its turn ends: runners.sim.arrivals)."""
        cache, prefix = self.prefix_cache, self.prefix[request]
        if cache is None or prefix < 0:
            return
        if self.cached[request]:
            self._extend_prefix(request)
            return
        blocks, tokens = cache.size_of(prefix)
        if cache.can_insert(prefix) and self.blocks[request] > blocks:
            cache.insert(prefix, blocks, tokens)
            self.blocks[request] -= blocks
            self.cached[request] = tokens

    def _extend_prefix(self, request: int) -> None:
        """A request that found its key in part hands the blocks it computed past that part
        to the cache, as its key (which keeps the part resident while it is)."""
        cache, deeper = self.prefix_cache, self.deeper[request]
        assert cache is not None, "only a prefix cache extends a key"
        if deeper == NO_PREFIX or not cache.can_insert(deeper):
            return
        found = self.prefix[request]
        blocks, tokens = cache.size_of(deeper)
        # the part's whole length: a chained entry holds only the blocks past its own parent
        extra = blocks - cache.entries[found].tokens // cache.block_tokens
        if extra <= 0 or self.blocks[request] <= extra:
            return
        cache.insert(deeper, extra, tokens, parent=found)
        cache.release(found)  # it uses its own key now, which holds the part
        self.prefix[request], self.deeper[request] = deeper, NO_PREFIX
        self.blocks[request] -= extra
        self.cached[request] = tokens

    def _prefill_work(self, batch: list[int]) -> tuple[int, float, int]:
        """Prompt tokens computed, the attention pairs they form, and the cached tokens read."""
        tokens = prefix = 0
        pairs = 0.0
        for i in batch:
            prompt, cached = self.prompt[i], self.cached[i] + self.restored[i]
            tokens += prompt - cached
            pairs += prompt * (prompt + 1) / 2 - cached * (cached + 1) / 2
            prefix += cached
        return tokens, pairs, prefix

    def _pick_prefills(
        self, budget: float, seats: int, limit: int, alone_ok: bool = True
    ) -> list[int]:
        batch: list[int] = []
        tokens = 0
        cache = self.prefix_cache
        while self.waiting and len(batch) < min(seats, limit):
            request = self.waiting[0]
            if request in self.swapped:  # it copies its context back: runners.sim.swap
                need = self._blocks_for(self.prompt[request] + 1)
                if (tokens + 1 > budget and batch) or not self._free_up(need):
                    break
                self.waiting.popleft()
                self._take(need)
                self.blocks[request] = need
                self.reload_s += self._swap_back(request)
                batch.append(request)
                tokens += 1
                continue
            found, reload_s = self._acquire_prefix(request)
            computed = self.prompt[request] - found
            stored = None if reload_s is None else cache.host[self.prefix[request]]  # type: ignore[union-attr]
            reloaded = 0 if stored is None else stored.blocks
            need = self._blocks_for(computed + 1) + reloaded
            # A preempted request recomputes its prompt and what it generated, which may exceed
            # the budget: it then runs alone (when the step has room for it) rather than block
            # the queue.
            over = tokens + computed > budget
            admitted = not (over and (batch or not alone_ok)) and self._free_up(need)
            if admitted and stored is not None:
                # The evictions that made room may have pushed it out of a full host tier.
                admitted = cache.take_from_host(self.prefix[request]) is not None  # type: ignore[union-attr]
            if not admitted:
                self._release_prefix(request)
                break
            self.waiting.popleft()
            self._take(need)
            self.blocks[request] = need
            if stored is not None:  # the reloaded blocks are the cache's, used by it
                assert cache is not None and reload_s is not None, "only a cache reloads"
                cache.insert(self.prefix[request], stored.blocks, stored.tokens)
                cache.count_reload(stored)
                self.blocks[request] -= reloaded
                self.cached[request] = found
                self.reload_s += reload_s
            batch.append(request)
            tokens += computed
            if self.prefix[request] != NO_PREFIX and cache is not None:
                self.stats["prefix_lookups"] += 1
                self.stats["prefix_hits"] += found > 0
        return batch
