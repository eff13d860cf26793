"""LiteLLM's /key/block and /key/unblock: a key refused (401, LiteLLM's message) until
unblocked, its limits, budget and spend kept, as an operator stops a leaked or runaway key
without losing it. Were route 404s; revoking (/key/delete) was the only way to stop a key."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.gateway.admin import json_object
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.litellm_keys import _hash_of, database_key, key_info, key_spend

BLOCKED = "Authentication Error, Key is blocked. Update via `/key/unblock` if you're an admin."


def litellm_key_block_router(state) -> APIRouter:
    """state: the app's GatewayState (keys, spend, cfg)."""
    r = APIRouter(prefix="/key")

    async def set_blocked(request: Request, blocked: bool) -> dict:
        state.require_master(request)
        body = await json_object(request)
        for name in body:
            if name != "key":
                raise GatewayError(400, f"{name}: unknown field (key)", param=name)
        h = _hash_of(body.get("key"), "key")
        rec = await database_key(
            state.keys, h, "key: the master key cannot be blocked",
            "key: a key defined in the config file; block it there (blocked: true)",
        )  # fmt: skip
        spec = rec.spec.model_copy(update={"blocked": True if blocked else None})
        if not await state.keys.update_async(h, spec):  # (revoked meanwhile)
            raise GatewayError(404, "key: no such key", code="key_not_found", param="key")
        rec.spec = spec
        return key_info(rec, await key_spend(state.spend, rec))

    @r.post("/block")
    async def block(request: Request) -> dict:
        """{key}: the key (sk-...) or its hash; answers the key's info with blocked: true."""
        return await set_blocked(request, True)

    @r.post("/unblock")
    async def unblock(request: Request) -> dict:
        return await set_blocked(request, False)

    return r
