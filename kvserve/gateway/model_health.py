"""LiteLLM's GET /health with a key: the health of every deployment the key may call.

LiteLLM's proxy answers /health (key required) with `healthy_endpoints` / `unhealthy_endpoints`
and their counts; its users' monitors and scripts read those, and got `{"status": "ok"}` here
whatever the backends' state. Without a key /health stays the liveness answer, which probes
(Kubernetes, load balancers, uptime checks) call without one. A backend is healthy when it
answers GET /models (no generation is spent on it) and is not cooling down."""

from __future__ import annotations

import asyncio

from kvserve.gateway.config import Deployment
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.handler import Gateway
from kvserve.gateway.keys import KeyRecord


def _row(d: Deployment, master: bool, error: str | None) -> dict:
    row = {"model": d.model_name, "model_id": d.id, "backend_model": d.backend.model}
    if master:  # backend URLs are the operator's (model_info.py shows them to no virtual key)
        row["api_base"] = d.backend.base_url
    if error is not None:
        row["error"] = error
    return row


async def model_health(gw: Gateway, key: KeyRecord, model: str | None) -> dict:
    """`model`: one alias only (LiteLLM's `?model=`; a model_group_alias: its group's)."""
    allowed = gw.allowed_models(key)
    if model is not None and model not in gw.callable_names(key):
        raise GatewayError(404, f"model: {model!r} does not exist", code="model_not_found", param="model")
    model = None if model is None else gw.cfg.group_of(model)
    deps = [d for d in gw.cfg.model_list if d.model_name in allowed and model in (None, d.model_name)]
    up, cooling = await asyncio.gather(
        asyncio.gather(*(gw.pool.probe(d) for d in deps)), gw.store.cooling([d.id for d in deps])
    )
    master = key.source == "master"
    healthy, unhealthy = [], []
    for d, ok in zip(deps, up):
        if not ok:
            unhealthy.append(
                _row(d, master, "the backend did not answer GET /models (down, or refused the key)")
            )
        elif d.id in cooling:
            unhealthy.append(_row(d, master, "cooling down after failed requests"))
        else:
            healthy.append(_row(d, master, None))
    return {
        "healthy_endpoints": healthy,
        "unhealthy_endpoints": unhealthy,
        "healthy_count": len(healthy),
        "unhealthy_count": len(unhealthy),
    }
