"""LiteLLM's /key/regenerate (and /key/{key}/regenerate): a new key in place of a live one,
the old one refused from then on, its budget, limits, spend and batches going on with the
new one (LiteLLM rotates a key's token in its row). Was a route 404: rotating a leaked key
meant a new key with a fresh budget and spend, or keeping the leaked one."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvserve.gateway.admin import json_object
from kvserve.gateway.litellm_keys import (
    _hash_of,
    _spec_fields,
    _validated,
    alias_free,
    database_key,
    key_info,
    key_spend,
)


def litellm_key_regenerate_router(state) -> APIRouter:
    """state: the app's GatewayState (keys, spend, cfg)."""
    r = APIRouter(prefix="/key")

    async def regenerate(request: Request, key: str | None) -> dict:
        state.require_master(request)
        body = await json_object(request) if await request.body() else {}
        given = key if key is not None else body.get("key")
        h = _hash_of(given, "key")
        rec = await database_key(
            state.keys, h, "key: the master key is changed in the config file",
            "key: a key defined in the config file; change it there",
        )  # fmt: skip
        # (LiteLLM's other fields given a value, new_key and grace_period among them: 400 by name)
        fields = {"account": rec.account, **_spec_fields(body, {"key"})}
        spec = _validated({**rec.spec.model_dump(exclude_none=True), **fields}, state.cfg)
        await alias_free(state.keys, spec.alias, h)  # (its own, the key it replaces)
        new, made = await state.keys.create_async(spec)
        await state.keys.revoke_async(h)  # (after: a failure leaves both keys, never neither)
        return {"key": new, **key_info(made, await key_spend(state.spend, made), new)}

    @r.post("/regenerate")
    async def regenerate_named_in_body(request: Request) -> dict:
        """{key, fields...}: the fields given a value change, as /key/update's."""
        return await regenerate(request, None)

    @r.post("/{key}/regenerate")
    async def regenerate_named_in_path(request: Request, key: str) -> dict:
        return await regenerate(request, key)

    return r
