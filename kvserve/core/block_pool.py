"""The pool of physical KV blocks: reference counts, an LRU free queue, and the prefix cache.

A block is in use while its reference count is > 0; requests sharing content (a common
prefix, the n samples of one prompt) each hold a reference. A full block can carry a hash
of its content (see `hash_block`); the pool maps hashes to blocks so later requests can
reuse them. Freed blocks keep their content and hash and go to the back of the free queue;
allocation takes from the front, so cached blocks are evicted least-recently-used, and
only when the pool needs them. A referenced block is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None) -> BlockHash:
    """Chained SHA-256 over (parent block's hash, this block's tokens as int64, extra keys).

    Cryptographic, so two different prefixes never share a hash in practice: a cache hit
    can never return another prefix's KV. The data-parallel router computes the same chain
    (`hash_prompt_blocks`) to know exactly which replica holds a prompt's blocks.
    """
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"|" + extra.encode())
    return h.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, extra: str | None = None, limit: int | None = None
) -> list[BlockHash]:
    """The chain of hashes of every full block of `token_ids` (at most `limit` blocks)."""
    n = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    out: list[BlockHash] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


class KVEvents:
    """Block hashes that entered or left the prefix cache since the last `drain` (vLLM's KV
    events idea): the engine core publishes them with its step outputs so a router can keep
    an exact copy of each replica's cached hashes. Per hash only the last change counts (a
    block evicted and recomputed in one step is cached); `cleared`: forget everything first."""

    __slots__ = ("changes", "cleared")

    def __init__(self) -> None:
        self.changes: dict[BlockHash, bool] = {}  # hash -> cached now (True) or gone (False)
        self.cleared = False

    def drain(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last drain."""
        stored = [h for h, cached in self.changes.items() if cached]
        removed = [h for h, cached in self.changes.items() if not cached]
        cleared = self.cleared
        self.changes, self.cleared = {}, False
        return stored, removed, cleared


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> block holding that content
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0  # cached blocks whose content was dropped to make room
        self.events: KVEvents | None = None  # set by a core that publishes its cache contents

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks from the front of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            self.num_evictions += 1
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.events is not None:
                    self.events.changes[h] = False

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a cache hit), pulling free ones out of the queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def cache(self, b: int, h: BlockHash) -> None:
        """Record that block b (full, in use) holds the content hashed as h."""
        if self.block_hash[b] is None and h not in self.cached:
            self.block_hash[b] = h
            self.cached[h] = b
            if self.events is not None:
                self.events.changes[h] = True

    def uncache(self, b: int) -> None:
        """Forget block b's hash (its content turned out not to be what the hash says)."""
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.events is not None:
                    self.events.changes[h] = False

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the back of the queue."""
        for b in blocks:
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their content). Returns how many."""
        n = len(self.cached)
        self.cached.clear()
        if self.events is not None:
            self.events.changes.clear()
            self.events.cleared = True
        self.block_hash = [None] * self.num_blocks
        return n

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks
