"""LiteLLM's user paths (/user/new, /user/info, /user/list, /user/update, /user/delete) over users.py, with
LiteLLM's field names and answer shapes: a user owns keys (/key/generate's user_id), and its
max_budget, budget_duration, rpm_limit, tpm_limit and max_parallel_requests cap all its keys
together (limits.tenant_checks). Were route 404s: a LiteLLM proxy user's onboarding scripts
failed at their first call, and a per-person budget could not be set. LiteLLM's fields with no
meaning here (teams, organizations, roles that grant admin rights, ...) are a 400 by name."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from kvserve.gateway.admin import _first_error, json_object
from kvserve.gateway.budgets import budget_period
from kvserve.gateway.config import UserSpec, storable_text
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.litellm_keys import (
    _iso,
    _models,
    _spec_fields,
    _validated,
    alias_free,
    info_scope,
    key_info,
    key_spend,
)
from kvserve.gateway.model_limits import budgets_shown, unknown_models
from kvserve.gateway.users import UserRecord

# LiteLLM's name -> UserSpec's
FIELDS = {
    "user_email": "user_email",
    "user_alias": "user_alias",
    "models": "models",
    "max_budget": "max_budget",
    "budget_duration": "budget_duration",
    "rpm_limit": "rpm",
    "tpm_limit": "tpm",
    "max_parallel_requests": "max_parallel_requests",
    "metadata": "metadata",
    "model_max_budget": "model_max_budget",
}
# roles LiteLLM gives an ordinary user (its admin roles would be a promise the gateway cannot keep)
ROLES = ("internal_user", "internal_user_viewer", "customer")
# /user/new's fields for the key it makes (LiteLLM's auto_create_key)
_KEY_FIELDS = {"key_alias", "duration"}


def _user_fields(body: dict, skip: set[str]) -> dict:
    """LiteLLM's fields -> UserSpec's; a null is no value; any other field with a value: 400."""
    out: dict = {}
    for name, value in body.items():
        if name in skip or value is None:
            continue
        if name == "user_role":
            if value not in ROLES:
                msg = f"user_role: one of {', '.join(ROLES)} (the gateway's admin is its master key)"
                raise GatewayError(400, msg, param="user_role")
            out["user_role"] = value
        elif name == "models":
            out["models"] = _models(value)
        elif name in FIELDS:
            out[FIELDS[name]] = value
        else:
            raise GatewayError(
                400,
                f"{name}: not supported by the kvserve gateway's users (supported: "
                f"{', '.join([*FIELDS, 'user_role'])}; docs/GATEWAY.md)",
                code="unsupported_parameter",
                param=name,
            )
    return out


def _spec(data: dict, cfg) -> UserSpec:
    try:
        spec = UserSpec.model_validate(data)
    except ValidationError as e:
        back = {v: k for k, v in FIELDS.items()}
        field = str(e.errors()[0]["loc"][0]) if e.errors()[0]["loc"] else ""
        msg = _first_error(e)
        if field in back:
            msg = back[field] + msg[len(field) :]
        raise GatewayError(400, msg, code="invalid_value", param=back.get(field, field) or None) from None
    names = cfg.names()
    for m in spec.models or []:
        if m not in names:
            raise GatewayError(404, f"models: {m!r} does not exist", code="model_not_found", param="models")
    unknown = unknown_models(spec, names)
    if unknown is not None:  # (a budget on no model the gateway serves caps nothing)
        raise GatewayError(400, f"{unknown[0]}: {unknown[1]!r} does not exist", code="model_not_found",
                           param=unknown[0])  # fmt: skip
    return spec


def user_info(rec: UserRecord, spend: float) -> dict:
    """A user as LiteLLM's /user/info describes it."""
    s = rec.spec
    return {
        "user_id": rec.user_id,
        "user_email": s.user_email,
        "user_alias": s.user_alias,
        "user_role": s.user_role or "internal_user",
        "models": s.models or [],
        "max_budget": s.max_budget,
        "budget_duration": s.budget_duration,
        "budget_reset_at": _iso(budget_period(s.budget_duration, time.time())[1]),
        "tpm_limit": s.tpm,
        "rpm_limit": s.rpm,
        "max_parallel_requests": s.max_parallel_requests,
        "model_max_budget": budgets_shown(s.model_max_budget),
        "metadata": s.metadata or {},
        "spend": spend,
        "teams": [],
        "created_at": _iso(rec.created),
    }


def litellm_user_router(state) -> APIRouter:
    """state: the app's GatewayState (keys, users, spend, cfg)."""
    r = APIRouter(prefix="/user")

    async def spent(rec: UserRecord) -> float:
        """In the user budget's current period, as LiteLLM shows it (key_spend)."""
        since = budget_period(rec.spec.budget_duration, time.time())[0]
        return await state.spend.spent(since, user=rec.user_id)

    async def found(user_id: object, param: str = "user_id") -> UserRecord:
        if not isinstance(user_id, str) or not user_id:
            raise GatewayError(400, f"{param}: expected a user id", param=param)
        rec = await state.users.get(user_id)
        if rec is None:
            msg = f"{param}: no user {user_id[:200]!r}"
            raise GatewayError(404, msg, code="user_not_found", param=param)
        return rec

    async def keys_of(user_id: str) -> list:
        return [k for k in await state.keys.list_async() if not k.revoked and k.spec.user == user_id]

    @r.post("/new")
    async def new(request: Request) -> dict:
        """A user, and (LiteLLM's auto_create_key, true by default) a key it owns."""
        state.require_master(request)
        body = await json_object(request)
        user_id = body.get("user_id") or str(uuid.uuid4())
        try:
            storable_text(user_id if isinstance(user_id, str) else None)
        except ValueError as e:
            raise GatewayError(400, f"user_id: {e}", param="user_id") from None
        if not isinstance(user_id, str) or len(user_id) > 256:
            raise GatewayError(400, "user_id: expected a string (at most 256 characters)", param="user_id")
        auto = body.get("auto_create_key", True)
        if not isinstance(auto, bool):
            raise GatewayError(400, "auto_create_key: expected true or false", param="auto_create_key")
        rec = UserRecord(
            user_id, _spec(_user_fields(body, {"user_id", "auto_create_key", *_KEY_FIELDS}), state.cfg)
        )
        key_body = {k: body[k] for k in _KEY_FIELDS if body.get(k) is not None} if auto else {}
        key_spec = _validated({**_spec_fields(key_body, set()), "user": user_id}, state.cfg) if auto else None
        if key_spec is not None:
            await alias_free(state.keys, key_spec.alias)
        email = (rec.spec.user_email or "").casefold()
        if email and any((u.spec.user_email or "").casefold() == email for u in await state.users.all()):
            msg = f"User with email {rec.spec.user_email[:200]} already exists"  # (LiteLLM's rule, its 409)
            raise GatewayError(409, msg, code="user_exists", param="user_email")
        if not await state.users.create(rec):
            msg = f"User with id {user_id[:200]} already exists"  # (LiteLLM's words, and its 409)
            raise GatewayError(409, msg, code="user_exists", param="user_id")
        out = {"key": None, "token": None, "key_alias": None, "expires": None}
        if key_spec is not None:
            try:
                key, made = await state.keys.create_async(key_spec)
            except BaseException:
                await state.users.delete(user_id)  # (made whole or not at all)
                raise
            out = {"key": key, **key_info(made, 0.0, key)}
        return {**out, **user_info(rec, 0.0)}

    @r.get("/info")
    async def info(request: Request, user_id: str | None = None) -> dict:
        """The master key reads any user; another key only its own (no ?user_id: its own)."""
        user_id = await info_scope(state, request, user_id, "user")
        rec = await found(user_id)
        keys = await keys_of(user_id)
        return {
            "user_id": user_id,
            "user_info": user_info(rec, await spent(rec)),
            "keys": [key_info(k, await key_spend(state.spend, k)) for k in keys],
            "teams": [],
        }

    @r.get("/list")
    async def list_users(
        request: Request,
        user_ids: str | None = None,
        page: int = Query(1, ge=1),
        page_size: int = Query(25, ge=1, le=100),
    ) -> dict:
        """LiteLLM's page of users (25 by default, newest first) with each one's spend and key
        count; user_ids= (comma-separated) narrows to those."""
        state.require_master(request)
        wanted = None if user_ids is None else {u.strip() for u in user_ids.split(",") if u.strip()}
        users = [u for u in reversed(await state.users.all()) if wanted is None or u.user_id in wanted]
        shown = users[(page - 1) * page_size : page * page_size]
        counts: dict[str, int] = {}
        for k in await state.keys.list_async():
            if not k.revoked and k.spec.user is not None:
                counts[k.spec.user] = counts.get(k.spec.user, 0) + 1
        out = [{**user_info(u, await spent(u)), "key_count": counts.get(u.user_id, 0)} for u in shown]
        pages = max(-(-len(users) // page_size), 1)
        return {"users": out, "total": len(users), "page": page, "page_size": page_size, "total_pages": pages}

    @r.post("/update")
    async def update(request: Request) -> dict:
        """The fields given a value change; the user is named by user_id (or user_email)."""
        state.require_master(request)
        body = await json_object(request)
        if body.get("user_id") is None and isinstance(body.get("user_email"), str):
            match = [u for u in await state.users.all() if u.spec.user_email == body["user_email"]]
            if not match:
                raise GatewayError(404, "user_email: no such user", code="user_not_found", param="user_email")
            rec = match[0]
        else:
            rec = await found(body.get("user_id"))
        merged = {**rec.spec.model_dump(exclude_none=True), **_user_fields(body, {"user_id"})}
        rec.spec = _spec(merged, state.cfg)
        if await state.users.get(rec.user_id) is None:  # (deleted meanwhile: not brought back)
            raise GatewayError(404, f"user_id: no user {rec.user_id[:200]!r}", code="user_not_found",
                               param="user_id")  # fmt: skip
        await state.users.replace(rec)
        return {"user_id": rec.user_id, "data": user_info(rec, await spent(rec))}

    @r.post("/delete")
    async def delete(request: Request) -> dict:
        """{user_ids: [...]}: every one found, or none deleted (404); their keys are deleted with
        them, as LiteLLM's are."""
        state.require_master(request)
        body = await json_object(request)
        for name in body:
            if name != "user_ids":
                raise GatewayError(400, f"{name}: unknown field (user_ids)", param=name)
        ids = body.get("user_ids")
        if not isinstance(ids, list) or not ids:
            raise GatewayError(400, "user_ids: a list of user ids", param="user_ids")
        for u in ids:
            await found(u, "user_ids")
        for u in ids:
            for k in await keys_of(u):
                await state.keys.revoke_async(k.key_hash)
            await state.users.delete(u)
        return {"deleted_users": list(dict.fromkeys(ids))}

    return r
