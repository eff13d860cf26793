"""/health/ready's answer within a deadline, so one hung dependency cannot fail the probe.

A Kubernetes readiness probe gives up after its timeoutSeconds (1 s unless set) and counts that
as not ready. The check waited for every backend's GET /models (up to 2 s each, in parallel)
and for Redis (its 5 s socket timeout): one hung backend out of many made every gateway
replica unready at once, so the Service lost all its endpoints while other backends could
serve. Now each check has READY_DEADLINE_S; what has not answered by then counts as down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from kvserve.gateway.backends import BackendPool
from kvserve.gateway.config import Deployment
from kvserve.gateway.state.base import StateStore

# under the probe's default timeoutSeconds (1 s), with room for the request itself
READY_DEADLINE_S = 0.7
T = TypeVar("T")


async def _within(check: Awaitable[T], failed: T) -> T:
    """`check`'s answer, or `failed` when it raises or has not answered by the deadline."""
    try:
        return await asyncio.wait_for(check, READY_DEADLINE_S)
    except Exception:  # a timeout, or the store's own error (StoreUnavailable): not ready
        return failed


async def readiness(
    pool: BackendPool, store: StateStore, deps: list[Deployment]
) -> tuple[bool, dict[str, Any]]:
    """(ready, body): the state store answers and one deployment is up and not cooling down."""
    up, cooling, store_ok = await asyncio.gather(
        asyncio.gather(*(_within(pool.probe(d), False) for d in deps)),
        _within(store.cooling([d.id for d in deps]), None),
        _within(store.ping(), False),
    )
    store_ok = store_ok and cooling is not None
    cooling = cooling or set()
    rows = [
        {"id": d.id, "model_name": d.model_name, "up": u, "cooling_down": d.id in cooling}
        for d, u in zip(deps, up)
    ]
    ready = store_ok and any(r["up"] and not r["cooling_down"] for r in rows)
    body = {"status": "ready" if ready else "not_ready", "state_store": store_ok, "deployments": rows}
    return ready, body
