"""Prompt blocks shared between requests (a trace's block ids: Mooncake's hash_ids) as prefix
cache keys: which requests can find which part of their prompt cached.

Two prompts that begin with the same blocks begin with the same text, so an engine's prefix
cache can serve the one from the other (vLLM's and MindIE's block hashes chain each block to
the ones before it: only a common start is shared). Over the blocks of every prompt, a request's
key is the longest start of its prompt that another request also begins with, its size that
start's blocks (the last one as far as the shortest prompt through it goes; a request finds at
most its prompt's tokens but one, for it computes a token of its own: runners.sim.admission); a
key's ancestor is the next shorter start that is itself a key, where a
request finds part of its key when only that is cached. A prompt no other shares a block
with has no key: its blocks are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_KEY = -1


@dataclass(frozen=True)
class PrefixChains:
    key: np.ndarray  # per request, its key (NO_KEY: none)
    tokens: np.ndarray  # per key, the prompt tokens it holds
    ancestor: np.ndarray  # per key, the next shorter key it starts with (NO_KEY: none)

    def tiled(self, copy: np.ndarray, order: np.ndarray) -> PrefixChains:
        """The keys of a load that replays the window `order` (its requests) in `copy` (which
        replay of the window): each replay's keys its own."""
        count = self.tokens.size
        key = self.key[order]
        key = np.where(key == NO_KEY, NO_KEY, key + copy * count)
        copies = int(copy.max()) + 1 if copy.size else 1
        offsets = np.repeat(np.arange(copies, dtype=np.int64) * count, count)
        ancestor = np.tile(self.ancestor, copies)
        ancestor = np.where(ancestor == NO_KEY, NO_KEY, ancestor + offsets)
        return PrefixChains(key, np.tile(self.tokens, copies), ancestor)


def chain_keys(blocks: list[np.ndarray], inputs: np.ndarray, block_tokens: int) -> PrefixChains:
    """The module's keys of prompts with these block ids and lengths."""
    child: dict[tuple[int, int], int] = {}  # (node, next block id) -> node
    users: list[int] = []  # per node: the prompts that start with it
    least: list[int] = []  # per node: the shortest such prompt, in tokens
    depth: list[int] = []
    parent: list[int] = []
    paths: list[list[int]] = []
    for chain, length in zip(blocks, inputs.tolist(), strict=True):
        node, path = NO_KEY, []
        for block in chain.tolist():
            nxt = child.get((node, block))
            if nxt is None:
                nxt = len(users)
                child[(node, block)] = nxt
                users.append(0)
                least.append(length)
                depth.append(1 if node == NO_KEY else depth[node] + 1)
                parent.append(node)
            users[nxt] += 1
            least[nxt] = min(least[nxt], length)
            path.append(nxt)
            node = nxt
        paths.append(path)
    deepest = [next((n for n in reversed(path) if users[n] >= 2), NO_KEY) for path in paths]
    key_of: dict[int, int] = {}
    for node in deepest:
        if node != NO_KEY and node not in key_of:
            key_of[node] = len(key_of)
    tokens = np.zeros(len(key_of), dtype=np.int64)
    ancestor = np.full(len(key_of), NO_KEY, dtype=np.int64)
    for node, key in key_of.items():
        tokens[key] = min(depth[node] * block_tokens, least[node])
        up = parent[node]
        while up != NO_KEY and up not in key_of:
            up = parent[up]
        ancestor[key] = key_of.get(up, NO_KEY)
    keys = np.array([key_of.get(node, NO_KEY) for node in deepest], dtype=np.int64)
    return PrefixChains(keys, tokens, ancestor)


def session_blocks(
    session: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, block_tokens: int
) -> list[np.ndarray]:
    """Block ids for a trace's conversations: a turn whose prompt is at least as long as its
    session's previous prompt and answer starts with them (a chat client sends the whole
    history), so it shares their whole blocks; any other prompt is text of its own."""
    fresh = 0
    context: dict[int, tuple[list[int], int]] = {}  # session -> its history's blocks, tokens
    out: list[np.ndarray] = []
    for s, prompt, answer in zip(session.tolist(), inputs.tolist(), outputs.tolist(), strict=True):
        ids, history = context.get(s, ([], 0))
        shared = ids[: history // block_tokens] if prompt >= history else []
        need = -(-(prompt + answer) // block_tokens)  # the blocks its context fills
        own = list(range(fresh, fresh + need - len(shared)))
        fresh += len(own)
        whole = shared + own
        context[s] = (whole, prompt + answer)
        out.append(np.asarray(whole[: -(-prompt // block_tokens)], dtype=np.int64))
    return out
