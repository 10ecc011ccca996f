"""Prefix caching in the simulator: the KV blocks of a shared prompt prefix (or of a session's
history, runners.sim.arrivals), computed once and kept while memory allows, and a
host-memory tier below it.

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


@dataclass
class Entry:
    blocks: int  # device blocks it holds
    tokens: int  # prompt tokens a hit saves


class PrefixCache:
    def __init__(self, prefix_tokens: int, block_tokens: int, host: HostTier | None = None):
        # A shared prefix's entry (sessions' entries are sized as their histories grow).
        self.block_tokens = block_tokens
        self.blocks = prefix_tokens // block_tokens
        self.tokens = self.blocks * block_tokens
        self.users: dict[int, int] = {}  # resident prefix -> running requests that use it
        self.entries: dict[int, Entry] = {}  # resident prefix -> its size
        # resident prefix -> the entry its first blocks are (kept resident, used, meanwhile)
        self.parent: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # unused, least recently used first
        self.idle_blocks = 0  # blocks held by idle prefixes: memory that can be taken back
        self.resident_blocks = 0
        self.host_tier = host
        self.host: OrderedDict[int, Entry] = OrderedDict()  # offloaded, least recently used first
        self.host_blocks = 0
        # A trace's keys (runners.load.prefix_chains): each one's tokens and the shorter key it
        # starts with; none: every key is the shared prefix's size.
        self.sizes: list[int] = []
        self.ancestor: list[int] = []
        self.stats: dict[str, float] = {"prefix_evictions": 0}
        if host is not None and host.blocks:
            self.stats |= {"prefix_offloads": 0, "prefix_reloads": 0, "host_drops": 0}
            self.stats |= {"kv_offloaded_gb": 0.0, "kv_reloaded_gb": 0.0}

    def acquire(self, prefix: int) -> int:
        """A request starting with `prefix` is admitted: the prompt tokens it finds on the
        device."""
        if prefix not in self.users:
            return 0
        self._use(prefix)
        return self.entries[prefix].tokens

    def _use(self, prefix: int) -> None:
        self.users[prefix] += 1
        if prefix in self.idle:
            del self.idle[prefix]
            self.idle_blocks -= self.entries[prefix].blocks

    def chain(self, sizes: list[int], ancestor: list[int]) -> None:
        """Keys of their own sizes, each starting with its ancestor's blocks."""
        self.sizes, self.ancestor = sizes, ancestor

    def size_of(self, prefix: int) -> tuple[int, int]:
        """A key's whole blocks and the prompt tokens they hold."""
        if not self.sizes:
            return self.blocks, self.tokens
        blocks = self.sizes[prefix] // self.block_tokens
        return blocks, blocks * self.block_tokens

    def resident_start(self, prefix: int) -> int:
        """The longest key on the device that `prefix` starts with (-1: none)."""
        if not self.ancestor:
            return -1
        start = self.ancestor[prefix]
        while start >= 0 and start not in self.users:
            start = self.ancestor[start]
        return start

    def can_insert(self, prefix: int) -> bool:
        return self.size_of(prefix)[0] > 0 and prefix not in self.users

    def insert(
        self,
        prefix: int,
        blocks: int | None = None,
        tokens: int | None = None,
        in_use: bool = True,
        parent: int | None = None,
    ) -> None:
        """A request computed (or reloaded) the prefix: its blocks are the cache's, used by it
        (or, `in_use` false, idle). Default size: the shared prefix's. `parent`: a resident
        entry holding its first blocks, used by it while it is resident."""
        entry = Entry(
            self.blocks if blocks is None else blocks, self.tokens if tokens is None else tokens
        )
        self.take_from_host(prefix)  # the device's copy is the newer
        self.entries[prefix] = entry
        self.resident_blocks += entry.blocks
        self.users[prefix] = 1
        if parent is not None:
            self.parent[prefix] = parent
            self._use(parent)
        if not in_use:
            self.release(prefix)

    def grow(self, prefix: int, blocks: int, tokens: int) -> None:
        """The entry's one user extends it (a session's history by its latest turn)."""
        entry = self.entries[prefix]
        entry.blocks += blocks
        entry.tokens = tokens
        self.resident_blocks += blocks

    def release(self, prefix: int) -> None:
        """A request that used the cached prefix finished or was preempted."""
        self.users[prefix] -= 1
        if self.users[prefix] == 0:
            self.idle[prefix] = None  # the most recently used end
            self.idle_blocks += self.entries[prefix].blocks

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
        entry = self.entries.pop(prefix)
        freed = entry.blocks
        self.idle_blocks -= freed
        self.resident_blocks -= freed
        self.stats["prefix_evictions"] += 1
        if prefix in self.parent:
            self.release(self.parent.pop(prefix))
            entry = Entry(entry.tokens // self.block_tokens, entry.tokens)  # its copy, whole
        tier = self.host_tier
        if tier is not None and entry.blocks <= tier.blocks:
            self.host[prefix] = entry
            self.host_blocks += entry.blocks
            self.stats["prefix_offloads"] += 1
            self.stats["kv_offloaded_gb"] += entry.blocks * tier.block_bytes / 1e9
            while self.host_blocks > tier.blocks:
                _, dropped = self.host.popitem(last=False)
                self.host_blocks -= dropped.blocks
                self.stats["host_drops"] += 1
        return freed

    def reload_seconds(self, prefix: int) -> float | None:
        """What reloading a prefix from the host tier takes (None: not there); it is touched,
        the most recently used there now."""
        entry = self.host.get(prefix)
        if entry is None:
            return None
        self.host.move_to_end(prefix)
        assert self.host_tier is not None, "only a host tier holds prefixes on the host"
        return self.host_tier.latency_s + entry.blocks * self.host_tier.block_seconds

    def take_from_host(self, prefix: int) -> Entry | None:
        """The device takes the prefix back (the caller inserts it); None when the host
        dropped it since it was looked up."""
        entry = self.host.pop(prefix, None)
        if entry is not None:
            self.host_blocks -= entry.blocks
        return entry

    def count_reload(self, entry: Entry) -> None:
        assert self.host_tier is not None, "only a host tier reloads"
        self.stats["prefix_reloads"] += 1
        self.stats["kv_reloaded_gb"] += entry.blocks * self.host_tier.block_bytes / 1e9
