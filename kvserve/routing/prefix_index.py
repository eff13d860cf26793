"""Which prefix of a request each target already holds: the input of cache-aware routing.

- `BlockHashIndex` (exact, for kvserve engine replicas): per replica, the set of block hashes
  in its prefix cache, kept up to date from the stored/removed events the engine core
  publishes with its step outputs. The router hashes the prompt with the engine's own
  chained SHA-256 (`hash_prompt_blocks`), so a match here is a hit there, block for block;
  prompts routed but not yet reported count as pending on their replica for a while.
- `TextPrefixIndex` (approximate, for backends that publish nothing): per target, the chained
  hashes of 64-character chunks of the prompts routed there, least recently used first out.
  It is a prefix tree with fixed-size edges: it guesses that what was sent is still cached.

Both walk a request's chain from the first block and stop at the first key a target lacks, so
a decision costs O(prompt blocks x candidates), whatever the number of cached prefixes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvserve.core.block_pool import BlockHash, hash_prompt_blocks
from kvserve.routing.strategies import RequestInfo


class BlockHashIndex:
    """Exact copy of each replica's cached block hashes, plus what the router sent there that
    the replica has not yet reported.

    A replica reports a block once it is computed; under load a tenant's first request can wait
    tens of seconds for its prefill, and every request of that tenant routed meanwhile would
    see the prefix nowhere and be spread as a new prefix, caching it on both replicas (a first
    256-request attempt did that: hit rate 0.48 where 0.9 was possible). So the blocks of a
    routed prompt count as held by its replica ("pending") until the replica reports them or
    `pending_ttl` seconds pass, as SGLang's tree inserts a prompt when it routes it.
    """

    def __init__(self, block_size: int, pending_ttl: float = 120.0) -> None:
        self.block_size = block_size
        self.pending_ttl = pending_ttl
        self.cached: dict[str, set[BlockHash]] = {}
        self.pending: dict[str, dict[BlockHash, float]] = {}  # hash -> when it expires
        self._next_prune = 0.0

    def apply(
        self, target_id: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash], cleared: bool
    ) -> None:
        """One step's events from a replica (the removed first: the stored are the newer state)."""
        s = self.cached.setdefault(target_id, set())
        if cleared:
            s.clear()
        s.difference_update(removed)
        stored = list(stored)
        s.update(stored)
        pending = self.pending.get(target_id)
        if pending:
            for h in stored:
                pending.pop(h, None)

    def forget(self, target_id: str) -> None:
        """The replica's core died: its successor starts with an empty cache."""
        self.cached.pop(target_id, None)
        self.pending.pop(target_id, None)

    def size(self, target_id: str) -> int:
        """Blocks cached on the target (reported, not pending)."""
        return len(self.cached.get(target_id, ()))

    def matchable(self, request: RequestInfo) -> int:
        """The most `match` can report: every full block but the last token's."""
        n = len(request.token_ids or ())
        return max(0, n - 1) // self.block_size * self.block_size

    def _hashes(self, request: RequestInfo) -> list[BlockHash]:
        """The chain over the blocks the engine can hit (computed once per request)."""
        if request.block_hashes is None:
            tokens = request.token_ids or ()
            n = self.matchable(request) // self.block_size
            request.block_hashes = hash_prompt_blocks(tokens, self.block_size, request.cache_salt, n)
        return request.block_hashes

    def match(self, request: RequestInfo, target_ids: Sequence[str]) -> dict[str, int]:
        """Prompt tokens each target holds or will hold (the engine computes the last token
        anyway, so at most len - 1 tokens count, as in KVCacheManager)."""
        hits = dict.fromkeys(target_ids, 0)
        if not request.token_ids:
            return hits
        now = time.monotonic()
        for t in target_ids:
            cached, pending = self.cached.get(t, ()), self.pending.get(t, {})
            n = 0
            for h in self._hashes(request):
                if h not in cached and pending.get(h, 0.0) <= now:
                    break
                n += 1
            hits[t] = n * self.block_size
        return hits

    def routed(self, target_id: str, request: RequestInfo) -> None:
        """The prompt's blocks go to target_id: pending there until it reports them."""
        if not request.token_ids:
            return
        now = time.monotonic()
        pending = self.pending.setdefault(target_id, {})
        cached = self.cached.get(target_id, ())
        expires = now + self.pending_ttl
        for h in self._hashes(request):
            if h not in cached:
                pending[h] = expires
        if now >= self._next_prune:  # drop what expired (aborted requests, lost events)
            self._next_prune = now + self.pending_ttl
            for t, p in self.pending.items():
                self.pending[t] = {h: e for h, e in p.items() if e > now}


class TextPrefixIndex:
    """Approximate: chained keys of fixed-size character chunks of what was routed where.

    A key is Python's own hash of (parent key, chunk): SipHash in C, much cheaper than a
    blake2b object per chunk; a 64-bit collision costs at worst one misrouted request, and the
    index lives in one process, so the per-process hash seed does not matter. Only the first
    `max_chars` characters are matched: past a few thousand tokens the holder is decided, and
    the cost stays bounded for long prompts. A request's keys are computed once, for both
    `match` and `routed`.
    """

    def __init__(
        self,
        chunk_chars: int = 64,
        max_chunks_per_target: int = 200_000,
        chars_per_token: float = 4.0,
        max_chars: int = 16_384,
    ) -> None:
        self.chunk = chunk_chars
        self.max_chunks = max_chunks_per_target
        self.chars_per_token = chars_per_token
        self.max_chars = max_chars
        self.cached: dict[str, OrderedDict[int, None]] = {}

    def _keys(self, request: RequestInfo) -> list[int]:
        if request.text_keys is None:
            text, c = request.text or "", self.chunk
            end = min(len(text), self.max_chars) // c * c
            parent = hash(request.cache_salt or "")
            keys = []
            for i in range(0, end, c):
                parent = hash((parent, text[i : i + c]))
                keys.append(parent)
            request.text_keys = keys
        return request.text_keys

    def matchable(self, request: RequestInfo) -> int:
        """The most `match` can report for this request (its first max_chars characters)."""
        return int(len(self._keys(request)) * self.chunk / self.chars_per_token)

    def match(self, request: RequestInfo, target_ids: Sequence[str]) -> dict[str, int]:
        """Estimated prompt tokens each target holds (matched characters / chars_per_token)."""
        chunks = dict.fromkeys(target_ids, 0)
        keys = self._keys(request)
        for t in target_ids:
            s = self.cached.get(t)
            if s:
                n = 0
                for key in keys:
                    if key not in s:
                        break
                    n += 1
                chunks[t] = n
        return {t: int(n * self.chunk / self.chars_per_token) for t, n in chunks.items()}

    def routed(self, target_id: str, request: RequestInfo) -> None:
        """The prompt went to target_id: assume its chunks are cached there from now on. Tail
        first, so the oldest entry is a prompt's last chunk: what a full engine evicts first."""
        s = self.cached.setdefault(target_id, OrderedDict())
        for key in reversed(self._keys(request)):
            s[key] = None
            s.move_to_end(key)
        while len(s) > self.max_chunks:
            s.popitem(last=False)

    def forget(self, target_id: str) -> None:
        self.cached.pop(target_id, None)

    def size(self, target_id: str) -> int:
        """Chunks remembered for the target."""
        return len(self.cached.get(target_id, ()))
