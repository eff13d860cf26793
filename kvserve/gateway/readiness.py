"""/health/ready's answer: not ready unless the state store answers and one deployment is up and
not cooling down; each check within routing/probe_deadline.py's deadline, so a hung backend (its
probe's own timeout is 2 s) or a hung Redis (5 s) cannot fail a Kubernetes probe (1 s) of every
gateway replica while another backend serves."""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.gateway.backends import BackendPool
from kvserve.gateway.config import Deployment
from kvserve.gateway.state.base import StateStore
from kvserve.routing.probe_deadline import within


async def readiness(
    pool: BackendPool, store: StateStore, deps: list[Deployment]
) -> tuple[bool, dict[str, Any]]:
    """(ready, body): the state store answers and one deployment is up and not cooling down."""
    up, cooling, store_ok = await asyncio.gather(
        asyncio.gather(*(within(pool.probe(d), False) for d in deps)),
        within(store.cooling([d.id for d in deps]), None),
        within(store.ping(), False),
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
