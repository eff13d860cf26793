"""Which prefix of a request each target already holds: the input of cache-aware routing.

- `BlockHashIndex` (exact, for kvserve engine replicas): per replica, the set of block hashes
  in its prefix cache, kept up to date from the stored/removed events the engine core
  publishes with its step outputs. The router hashes the prompt with the engine's own
  chained SHA-256 (`hash_prompt_blocks`), so a match here is a hit there, block for block.
- `TextPrefixIndex` (approximate, for backends that publish nothing): per target, the chained
  hashes of 64-character chunks of the prompts routed there, least recently used first out.
  It is a prefix tree with fixed-size edges: it guesses that what was sent is still cached.

Both walk the chain from the first block and stop at the first key no candidate holds, so a
decision costs O(matched blocks x candidates), whatever the number of cached prefixes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvserve.core.block_pool import BlockHash, hash_block
from kvserve.routing.strategies import RequestInfo


class BlockHashIndex:
    """Exact copy of each replica's cached block hashes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cached: dict[str, set[BlockHash]] = {}

    def apply(
        self, target_id: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash], cleared: bool
    ) -> None:
        """One step's events from a replica (the removed first: the stored are the newer state)."""
        s = self.cached.setdefault(target_id, set())
        if cleared:
            s.clear()
        s.difference_update(removed)
        s.update(stored)

    def forget(self, target_id: str) -> None:
        """The replica's core died: its successor starts with an empty cache."""
        self.cached.pop(target_id, None)

    def size(self, target_id: str) -> int:
        """Blocks cached on the target."""
        return len(self.cached.get(target_id, ()))

    def match(self, request: RequestInfo, target_ids: Sequence[str]) -> dict[str, int]:
        """Prompt tokens each target would find cached (the engine computes the last token
        anyway, so at most len - 1 tokens count, as in KVCacheManager)."""
        hits = dict.fromkeys(target_ids, 0)
        tokens = request.token_ids
        if not tokens:
            return hits
        bs = self.block_size
        live = [(t, self.cached.get(t)) for t in target_ids]
        live = [(t, s) for t, s in live if s]
        parent: BlockHash | None = None
        for i in range((len(tokens) - 1) // bs):
            if not live:
                break
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt)
            live = [(t, s) for t, s in live if parent in s]
            for t, _ in live:
                hits[t] += bs
        return hits

    def routed(self, target_id: str, request: RequestInfo) -> None:
        """Nothing to guess: the replica will say what it cached."""


class TextPrefixIndex:
    """Approximate: chained hashes of fixed-size character chunks of what was routed where."""

    def __init__(
        self, chunk_chars: int = 64, max_chunks_per_target: int = 200_000, chars_per_token: float = 4.0
    ) -> None:
        self.chunk = chunk_chars
        self.max_chunks = max_chunks_per_target
        self.chars_per_token = chars_per_token
        self.cached: dict[str, OrderedDict[bytes, None]] = {}

    def _keys(self, request: RequestInfo):
        text = request.text or ""
        scope = (request.cache_salt or "").encode()
        parent = b""
        for i in range(len(text) // self.chunk):
            h = hashlib.blake2b(parent, digest_size=16, key=scope[:64])
            h.update(text[i * self.chunk : (i + 1) * self.chunk].encode())
            parent = h.digest()
            yield parent

    def match(self, request: RequestInfo, target_ids: Sequence[str]) -> dict[str, int]:
        """Estimated prompt tokens each target holds (matched characters / chars_per_token)."""
        chars = dict.fromkeys(target_ids, 0)
        live = [(t, self.cached[t]) for t in target_ids if self.cached.get(t)]
        for key in self._keys(request):
            live = [(t, s) for t, s in live if key in s]
            if not live:
                break
            for t, _ in live:
                chars[t] += self.chunk
        return {t: int(c / self.chars_per_token) for t, c in chars.items()}

    def routed(self, target_id: str, request: RequestInfo) -> None:
        """The prompt went to target_id: assume its chunks are cached there from now on."""
        s = self.cached.setdefault(target_id, OrderedDict())
        for key in self._keys(request):
            s[key] = None
            s.move_to_end(key)
        while len(s) > self.max_chunks:
            s.popitem(last=False)

    def forget(self, target_id: str) -> None:
        self.cached.pop(target_id, None)

    def size(self, target_id: str) -> int:
        """Chunks remembered for the target."""
        return len(self.cached.get(target_id, ()))
