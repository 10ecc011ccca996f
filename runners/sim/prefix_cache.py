"""Prefix caching in the simulator: the KV blocks of a shared prompt prefix, computed once and
kept while memory allows.

As vLLM's and MindIE's block caches do it: only whole blocks are cached (a prefix of S tokens
keeps floor(S / block) blocks, and the rest of its last block is computed again with the
request's own text); the blocks are shared by every running request that starts with that
prefix and held once; blocks no running request uses stay cached until memory is needed, then
go least recently used first. A prefix is kept or evicted whole: every request that uses it
uses all of its blocks, so a part of one would only be a shorter hit.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, prefix_tokens: int, block_tokens: int):
        self.blocks = prefix_tokens // block_tokens  # blocks one cached prefix holds
        self.tokens = self.blocks * block_tokens  # prompt tokens a hit saves
        self.users: dict[int, int] = {}  # resident prefix -> running requests that use it
        self.idle: OrderedDict[int, None] = OrderedDict()  # unused, least recently used first
        self.stats = {"prefix_evictions": 0}

    @property
    def idle_blocks(self) -> int:
        """Blocks held by prefixes no running request uses: memory that can be taken back."""
        return len(self.idle) * self.blocks

    def acquire(self, prefix: int) -> int:
        """A request starting with `prefix` is admitted: the prompt tokens it finds cached."""
        if prefix not in self.users:
            return 0
        self.users[prefix] += 1
        self.idle.pop(prefix, None)
        return self.tokens

    def can_insert(self, prefix: int) -> bool:
        return self.blocks > 0 and prefix not in self.users

    def insert(self, prefix: int) -> None:
        """A request computed the prefix: its first blocks become the cache's, used by it."""
        self.users[prefix] = 1

    def release(self, prefix: int) -> None:
        """A request that used the cached prefix finished or was preempted."""
        self.users[prefix] -= 1
        if self.users[prefix] == 0:
            self.idle[prefix] = None  # the most recently used end

    def evict(self) -> int:
        """Drop the least recently used idle prefix: the blocks freed (0 when none is idle)."""
        if not self.idle:
            return 0
        prefix, _ = self.idle.popitem(last=False)
        del self.users[prefix]
        self.stats["prefix_evictions"] += 1
        return self.blocks
