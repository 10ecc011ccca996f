"""Prefix caching in the simulator: the KV blocks of a shared prompt prefix, computed once and
kept while memory allows, and a host-memory tier below it.

As vLLM's and MindIE's block caches do it: only whole blocks are cached (a prefix of S tokens
keeps floor(S / block) blocks, and the rest of its last block is computed again with the
request's own text); the blocks are shared by every running request that starts with that
prefix and held once; blocks no running request uses stay cached until memory is needed, then
go least recently used first. A prefix is kept or evicted whole: every request that uses it
uses all of its blocks, so a part of one would only be a shorter hit.

With a host tier (vLLM's KV offloading, llama-server's RAM prompt cache), an evicted prefix
is copied to host memory instead of dropped, least recently used out first when that is full;
a request that starts with a prefix found there reloads its blocks over the host link before
its prefill, rather than computing them again. The copy out runs beside the engine's steps (as
vLLM's offloading stores do), the reload inside the step that needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class HostTier:
    blocks: int  # blocks host memory holds
    block_seconds: float  # one block over the host link
    latency_s: float  # per reload
    block_bytes: float


class PrefixCache:
    def __init__(self, prefix_tokens: int, block_tokens: int, host: HostTier | None = None):
        self.blocks = prefix_tokens // block_tokens  # blocks one cached prefix holds
        self.tokens = self.blocks * block_tokens  # prompt tokens a hit saves
        self.users: dict[int, int] = {}  # resident prefix -> running requests that use it
        self.idle: OrderedDict[int, None] = OrderedDict()  # unused, least recently used first
        self.host_tier = host
        self.host_slots = host.blocks // self.blocks if host is not None and self.blocks else 0
        self.host: OrderedDict[int, None] = OrderedDict()  # offloaded, least recently used first
        self.stats: dict[str, float] = {"prefix_evictions": 0}
        if self.host_slots:
            self.stats |= {"prefix_offloads": 0, "prefix_reloads": 0, "host_drops": 0}
            self.stats |= {"kv_offloaded_gb": 0.0, "kv_reloaded_gb": 0.0}

    @property
    def idle_blocks(self) -> int:
        """Blocks held by prefixes no running request uses: memory that can be taken back."""
        return len(self.idle) * self.blocks

    def acquire(self, prefix: int) -> int:
        """A request starting with `prefix` is admitted: the prompt tokens it finds on the
        device."""
        if prefix not in self.users:
            return 0
        self.users[prefix] += 1
        self.idle.pop(prefix, None)
        return self.tokens

    def can_insert(self, prefix: int) -> bool:
        return self.blocks > 0 and prefix not in self.users

    def insert(self, prefix: int) -> None:
        """A request computed (or reloaded) the prefix: its blocks are the cache's, used by it."""
        self.users[prefix] = 1

    def release(self, prefix: int) -> None:
        """A request that used the cached prefix finished or was preempted."""
        self.users[prefix] -= 1
        if self.users[prefix] == 0:
            self.idle[prefix] = None  # the most recently used end

    def make_room(self, free: int, need: int) -> int:
        """Evict idle prefixes until `need` blocks are free, where that is enough (as vLLM
        counts free and evictable blocks before it takes any): the blocks freed."""
        freed = 0
        if free + self.idle_blocks >= need:
            while free + freed < need:
                freed += self.evict()
        return freed

    def evict(self) -> int:
        """Drop the least recently used idle prefix from the device (to the host tier where
        there is one): the blocks freed (0 when none is idle)."""
        if not self.idle:
            return 0
        prefix, _ = self.idle.popitem(last=False)
        del self.users[prefix]
        self.stats["prefix_evictions"] += 1
        if self.host_slots:
            self.host[prefix] = None
            self.stats["prefix_offloads"] += 1
            self.stats["kv_offloaded_gb"] += self._gigabytes()
            if len(self.host) > self.host_slots:
                self.host.popitem(last=False)
                self.stats["host_drops"] += 1
        return self.blocks

    def reload_seconds(self, prefix: int) -> float | None:
        """What reloading a prefix from the host tier takes (None: not there); it is touched,
        the most recently used there now."""
        if prefix not in self.host:
            return None
        self.host.move_to_end(prefix)
        assert self.host_tier is not None, "only a host tier holds prefixes on the host"
        return self.host_tier.latency_s + self.blocks * self.host_tier.block_seconds

    def take_from_host(self, prefix: int) -> bool:
        """The device took the prefix back (the caller inserts it); False when the host
        dropped it since it was looked up."""
        if prefix not in self.host:
            return False
        del self.host[prefix]
        return True

    def count_reload(self) -> None:
        self.stats["prefix_reloads"] += 1
        self.stats["kv_reloaded_gb"] += self._gigabytes()

    def _gigabytes(self) -> float:
        assert self.host_tier is not None, "only a host tier moves bytes"
        return self.blocks * self.host_tier.block_bytes / 1e9
