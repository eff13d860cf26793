"""The gateway's response cache: a repeated request is answered from the state store without
a backend call ("return a cached response" when load is high, and cheaper when it is not).

Only non-streamed chat / completion requests are cached, and only greedy ones
(temperature 0) unless `any_temperature` is set: a sampled answer is one draw, and
replaying it would hide the variety the client asked for. A request sent with
`cache-control: no-cache` (or `no-store`) is neither answered from nor stored in the cache.
Hits carry `x-kvserve-cache: hit` (and `x-kvserve-cache-match: exact | semantic`); misses
that were stored carry `x-kvserve-cache: miss`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kvserve.gateway.backends import BackendPool
from kvserve.gateway.cache_keys import bucket_key, conversation_text, exact_key, guard
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.embeddings import EmbeddingError, cosine, embed
from kvserve.gateway.router import Router
from kvserve.gateway.state import StateStore, StoreUnavailable

log = logging.getLogger("kvserve.gateway")
HEADER = "x-kvserve-cache"


@dataclass
class Lookup:
    """One request's cache keys (and its embedding, so a miss stores it without a second call)."""

    key: str
    bucket: str | None = None
    vector: list[float] | None = None
    guard: str = ""
    hit: bytes | None = None
    match: str | None = None  # exact | semantic


def cacheable(body: dict, any_temperature: bool) -> bool:
    if body.get("stream") is True:
        return False
    temp = body.get("temperature")
    greedy = isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp == 0
    return greedy or any_temperature


class ResponseCache:
    def __init__(self, cfg: GatewayConfig, store: StateStore, pool: BackendPool, router: Router) -> None:
        self.cfg = cfg.response_cache
        self.store, self.pool, self.router = store, pool, router

    def applies(self, alias: str, body: dict, headers) -> bool:
        c = self.cfg
        if c is None or (c.models is not None and alias not in c.models):
            return False
        directive = (headers.get("cache-control") or "").lower() if headers is not None else ""
        if "no-cache" in directive or "no-store" in directive:
            return False
        return cacheable(body, c.any_temperature)

    async def lookup(self, alias: str, path: str, body: dict) -> Lookup:
        found = Lookup(exact_key(alias, path, body))
        try:
            found.hit = await self.store.cache_get(found.key)
            if found.hit is not None:
                found.match = "exact"
                return found
            sem = self.cfg.semantic
            if sem is not None and (sem.models is None or alias in sem.models):
                await self._semantic(found, alias, path, body)
        except StoreUnavailable as e:  # a cache that cannot be read is a miss, not an error
            log.warning("response cache: %s", e)
        return found

    async def _semantic(self, found: Lookup, alias: str, path: str, body: dict) -> None:
        sem = self.cfg.semantic
        text = conversation_text(body)
        found.bucket, found.guard = bucket_key(alias, path, body), guard(text)
        try:
            found.vector = await embed(self.pool, self.router, sem.embedding_model, text, sem.pooling)
        except EmbeddingError as e:
            log.warning("response cache (semantic): %s", e)
            return
        best, best_key = sem.threshold, None
        for raw in await self.store.cache_entries(found.bucket):
            entry = json.loads(raw)
            if entry["g"] != found.guard:
                continue  # a negation or a number differs: never the same question
            sim = cosine(found.vector, entry["v"])
            if sim >= best:
                best, best_key = sim, entry["k"]
        if best_key is not None:
            found.hit = await self.store.cache_get(best_key)
            found.match = "semantic" if found.hit is not None else None

    async def save(self, found: Lookup, content: bytes) -> None:
        ttl = self.cfg.ttl
        try:
            await self.store.cache_set(found.key, content, ttl)
            if found.bucket is not None and found.vector is not None:
                entry = json.dumps({"k": found.key, "g": found.guard, "v": found.vector}).encode()
                await self.store.cache_add(found.bucket, entry, ttl, self.cfg.semantic.max_entries)
        except StoreUnavailable as e:
            log.warning("response cache: not stored: %s", e)
