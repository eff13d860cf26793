"""Shared gateway state (rate-limit windows, budget reservations, cooldowns) behind one interface:
in process memory for a single instance, or Redis for N instances that must behave as one."""

from __future__ import annotations

from kvserve.gateway.state.base import Admission, Check, StateStore, StoreUnavailable


def open_store(url: str) -> StateStore:
    """'memory' or a redis:// URL."""
    if url == "memory":
        from kvserve.gateway.state.memory import MemoryStore

        return MemoryStore()
    from kvserve.gateway.state.redis_store import RedisStore

    return RedisStore(url)


__all__ = ["Admission", "Check", "StateStore", "StoreUnavailable", "open_store"]
