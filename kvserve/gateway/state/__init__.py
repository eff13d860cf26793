"""Shared gateway state (rate-limit windows, budget reservations, cooldowns) behind one interface:
in process memory for a single instance, or Redis for N instances that must behave as one."""

from __future__ import annotations

from kvserve.gateway.state.base import Admission, Check, StateStore, StoreUnavailable


def open_store(url: str, cache_max_bytes: int | None = None) -> StateStore:
    """'memory' or a redis:// URL. cache_max_bytes bounds the memory store's cached answers (a
    Redis is bounded by its own maxmemory)."""
    if url == "memory":
        from kvserve.gateway.state.memory import DEFAULT_CACHE_BYTES, MemoryStore

        return MemoryStore(cache_max_bytes=cache_max_bytes or DEFAULT_CACHE_BYTES)
    from kvserve.gateway.state.redis_store import RedisStore

    return RedisStore(url)


__all__ = ["Admission", "Check", "StateStore", "StoreUnavailable", "open_store"]
