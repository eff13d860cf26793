"""Shared gateway state (rate-limit windows, budget reservations, cooldowns) behind one interface:
in process memory for a single instance, or Redis for N instances that must behave as one."""

from __future__ import annotations

from urllib.parse import urlparse

from kvserve.gateway.state.base import Admission, Check, StateStore, StoreUnavailable


def open_store(url: str, cache_max_bytes: int | None = None) -> StateStore:
    """'memory' or a redis:// URL. cache_max_bytes bounds the memory store's cached answers (a
    Redis is bounded by its own maxmemory)."""
    if url == "memory":
        from kvserve.gateway.state.memory import DEFAULT_CACHE_BYTES, MemoryStore

        return MemoryStore(cache_max_bytes=cache_max_bytes or DEFAULT_CACHE_BYTES)
    from kvserve.gateway.state.redis_store import RedisStore

    return RedisStore(url)


def same_redis_server(a: str, b: str) -> bool:
    """Whether two store URLs name one Redis server: another db number on it shares its memory
    (and its maxmemory eviction) all the same."""
    if "memory" in (a, b):
        return False
    ua, ub = urlparse(a), urlparse(b)
    if "unix" in (ua.scheme, ub.scheme):
        return ua.scheme == ub.scheme and ua.path == ub.path
    return (ua.hostname, ua.port or 6379) == (ub.hostname, ub.port or 6379)


__all__ = ["Admission", "Check", "StateStore", "StoreUnavailable", "open_store", "same_redis_server"]
