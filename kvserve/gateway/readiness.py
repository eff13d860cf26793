"""/health/ready's answer, in LiteLLM's /health/readiness shape: not ready unless the state
store answers and one deployment is up and not cooling down; each check within
routing/probe_deadline.py's deadline, so a hung backend (its probe's own timeout is 2 s) or a
hung Redis (5 s) cannot fail a Kubernetes probe (1 s) of every gateway replica while another
backend serves."""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve import __version__
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
    return ready, answer(ready, store_ok, rows)


def answer(ready: bool, store_ok: bool | None, rows: list[dict], **more: Any) -> dict[str, Any]:
    """LiteLLM's /health/readiness fields first (`status` "healthy", `db` "connected": its users'
    probes and scripts parse them; "unhealthy" where LiteLLM answers its 503), then ours. `db` is
    the state store (keys, budgets); None when it was not asked (draining)."""
    db = None if store_ok is None else "connected" if store_ok else "disconnected"
    return {"status": "healthy" if ready else "unhealthy", "db": db, "kvserve_version": __version__,
            "ready": ready, **more, "state_store": store_ok, "deployments": rows}  # fmt: skip
