"""LiteLLM's key management API (/key/generate, /key/info, /key/update, /key/delete, /key/list)
over the gateway's keys, with LiteLLM's field names and answer shapes: a LiteLLM proxy user's
scripts called these paths and met route 404s (the gateway's own API is /admin/keys).

LiteLLM's fields that map onto a key here are taken (key_alias, models, team_id, rpm_limit,
tpm_limit, max_parallel_requests, max_budget, budget_duration, metadata, blocked, duration, user_id:
litellm_users.py, model_max_budget, model_rpm_limit, model_tpm_limit: model_limits.py); any other
with a value is a 400 naming it, never silently dropped (a budget or permission the caller
believes is set). LiteLLM's `models: []` means every model, as here a key without `models`."""

from __future__ import annotations

import datetime
import re
import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from kvserve.gateway.admin import _first_error, check_references, json_object
from kvserve.gateway.auth_headers import presented_key
from kvserve.gateway.budgets import budget_period
from kvserve.gateway.config import KeySpec
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.key_expiry import expires_at
from kvserve.gateway.keys import KeyRecord, KeyStore, hash_key
from kvserve.gateway.model_limits import budgets_shown
from kvserve.gateway.spend import SpendLog
from kvserve.gateway.users import user_made

# LiteLLM's name -> KeySpec's
FIELDS = {
    "key_alias": "alias",
    "models": "models",
    "team_id": "team",
    "rpm_limit": "rpm",
    "tpm_limit": "tpm",
    "max_parallel_requests": "max_parallel_requests",
    "max_budget": "max_budget",
    "budget_duration": "budget_duration",
    "metadata": "metadata",
    "blocked": "blocked",
    "user_id": "user",
    "model_max_budget": "model_max_budget",
    "model_rpm_limit": "model_rpm_limit",
    "model_tpm_limit": "model_tpm_limit",
}
_HASH = re.compile(r"[0-9a-f]{64}")
_EVERY_MODEL = ("all-proxy-models", "all-team-models")
# LiteLLM's /key/list filters on owners the gateway does not have
_NO_SUCH_FILTER = ("organization_id", "project_id", "access_group_id", "agent_id")


def _status(rec: KeyRecord) -> str:
    """LiteLLM's /key/list status: revoked is its word for blocked."""
    return "revoked" if rec.spec.blocked else "expired" if rec.expired else "active"


def _spec_fields(body: dict, allowed: set[str]) -> dict:
    """LiteLLM's fields -> KeySpec's; `duration` -> expires; any other field with a value: 400.
    A null is no value, as LiteLLM reads it (an update sent with the whole object, nulls
    included, changes only what has a value)."""
    out: dict = {}
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name == "duration":
            try:
                out["expires"] = expires_at(str(value), time.time())
            except ValueError as e:
                raise GatewayError(400, f"duration: {e}", param="duration") from None
        elif name == "models":
            out["models"] = _models(value)
        elif name in FIELDS:
            out[FIELDS[name]] = value
        else:
            raise GatewayError(
                400,
                f"{name}: not supported by the kvserve gateway's keys (supported: "
                f"{', '.join([*FIELDS, 'duration'])}; docs/GATEWAY.md)",
                code="unsupported_parameter",
                param=name,
            )
    return out


def _models(value: object) -> object:
    """LiteLLM's every-model forms ([], "all-proxy-models", "all-team-models": the team's
    `models` still apply) -> None, a key without `models` here."""
    if isinstance(value, list) and (not value or any(m in _EVERY_MODEL for m in value if isinstance(m, str))):
        return None
    return value


def _validated(data: dict, cfg) -> KeySpec:
    try:
        spec = KeySpec.model_validate(data)
    except ValidationError as e:
        back = {v: k for k, v in FIELDS.items()}  # name the field as the caller sent it
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        msg = _first_error(e)
        if field in back:
            msg = back[field] + msg[len(field) :]
        raise GatewayError(400, msg, code="invalid_value", param=back.get(field, field) or None) from None
    check_references(cfg, spec, team_param="team_id")
    return spec


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat()


def key_info(rec: KeyRecord, spend: float, given: str | None = None) -> dict:
    """A key as LiteLLM's /key/info describes it (`token` is the key's SHA-256, as LiteLLM's;
    `key_name` the key abbreviated, "sk-...wxyz", where the caller gave the key itself)."""
    s = rec.spec
    return {
        "token": rec.key_hash,
        "key_alias": s.alias,
        "key_name": f"sk-...{given[-4:]}" if given and not _HASH.fullmatch(given) else None,
        "models": s.models or [],
        "team_id": s.team,
        "user_id": s.user,
        "rpm_limit": s.rpm,
        "tpm_limit": s.tpm,
        "max_parallel_requests": s.max_parallel_requests,
        "max_budget": s.max_budget,
        "budget_duration": s.budget_duration,
        "metadata": s.metadata or {},
        "expires": _iso(s.expires),
        "budget_reset_at": _iso(budget_period(s.budget_duration, time.time())[1]),
        "model_max_budget": budgets_shown(s.model_max_budget),
        "model_rpm_limit": s.model_rpm_limit,
        "model_tpm_limit": s.model_tpm_limit,
        "blocked": bool(s.blocked),
        "spend": spend,
        "created_at": _iso(rec.created),
        "source": rec.source,
    }


async def key_spend(log: SpendLog, rec: KeyRecord) -> float:
    """A key's spend as LiteLLM shows it: in its budget's current period (LiteLLM sets it back to
    0 at each budget_duration reset; the whole log's total read as spent past max_budget)."""
    return await log.spent(budget_period(rec.spec.budget_duration, time.time())[0], key_hash=rec.account)


async def alias_free(keys: KeyStore, alias: str | None, own: str | None = None) -> None:
    """LiteLLM's rule: no two live keys share a key_alias (own: the key changed, its hash). Else
    a script making its key "if missing" made another at each run, and /key/delete by alias
    took them all."""
    if alias is not None and any(
        k.spec.alias == alias and not k.revoked and k.key_hash != own for k in await keys.list_async()
    ):
        msg = f"Key with alias {alias!r} already exists. Unique key aliases across all keys are required."
        raise GatewayError(400, msg, param="key_alias")


async def database_key(keys: KeyStore, key_hash: str, master: str, configured: str) -> KeyRecord:
    """The live key a route that changes keys (block, regenerate) may change: one made through
    the API. 404 when there is none; 400 with `master` or `configured` for the master key and a
    config file's key, which are changed in the config."""
    rec = await keys.record_async(key_hash)
    if rec is None:
        raise GatewayError(404, "key: no such key", code="key_not_found", param="key")
    if rec.source != "database":
        raise GatewayError(400, master if rec.source == "master" else configured, param="key")
    return rec


def _hash_of(value: object, param: str) -> str:
    """LiteLLM takes a key or its hash (`token`) wherever a key is named."""
    if not isinstance(value, str) or not value:
        raise GatewayError(400, f"{param}: expected a key (sk-...) or its hash", param=param)
    return value if _HASH.fullmatch(value) else hash_key(value)


def litellm_key_router(state) -> APIRouter:
    """state: the app's GatewayState (keys, spend, cfg)."""
    r = APIRouter(prefix="/key")

    async def spent(rec: KeyRecord) -> float:
        return await key_spend(state.spend, rec)

    async def live(key_hash: str, param: str) -> KeyRecord:
        rec = await state.keys.record_async(key_hash)
        if rec is None:
            raise GatewayError(404, f"{param}: no such key", code="key_not_found", param=param)
        return rec

    @r.post("/generate")
    async def generate(request: Request):
        state.require_master(request)
        body = await json_object(request)
        if body.get("key") is not None:
            raise GatewayError(400, "key: keys are generated by the gateway", param="key")
        spec = _validated(_spec_fields(body, {"key"}), state.cfg)
        await alias_free(state.keys, spec.alias)
        await user_made(state.users, spec)
        key, rec = await state.keys.create_async(spec)
        return {"key": key, **key_info(rec, 0.0, key)}

    @r.get("/info")
    async def info(request: Request, key: str | None = None):
        """The master key may read any key; another key only itself (LiteLLM's rule). Without
        ?key, the calling key, the master key included (LiteLLM's; it was a 400 for the master)."""
        caller = presented_key(request.headers)
        if key is None or (caller is not None and hash_key(caller) == _hash_of(key, "key")):
            rec = await state.authenticate(request)  # (401: none, unknown, revoked or expired)
            key = key or caller
        else:
            state.require_master(request)
            rec = await live(_hash_of(key, "key"), "key")
        return {"key": key, "info": key_info(rec, await spent(rec), key)}

    @r.post("/update")
    async def update(request: Request):
        state.require_master(request)
        body = await json_object(request)
        h = _hash_of(body.get("key"), "key")
        rec = await live(h, "key")
        if rec.source != "database":
            msg = "key: this key is defined in the config file; change it there"
            raise GatewayError(400, msg, param="key")
        merged = {**rec.spec.model_dump(exclude_none=True), **_spec_fields(body, {"key"})}
        spec = _validated(merged, state.cfg)
        await alias_free(state.keys, spec.alias, h)
        await user_made(state.users, spec)
        if not await state.keys.update_async(h, spec):
            raise GatewayError(404, "key: no such key", code="key_not_found", param="key")
        rec.spec = spec
        return {"key": body["key"], **key_info(rec, await spent(rec), body["key"])}

    @r.post("/delete")
    async def delete(request: Request):
        """{keys: [...]} and/or {key_aliases: [...]}: all found, or none deleted (404)."""
        state.require_master(request)
        body = await json_object(request)
        for name in body:
            if name not in ("keys", "key_aliases"):
                raise GatewayError(400, f"{name}: unknown field (keys, key_aliases)", param=name)
        named = body.get("keys") or []
        aliases = body.get("key_aliases") or []
        if not isinstance(named, list) or not isinstance(aliases, list) or not (named or aliases):
            raise GatewayError(400, "keys: a list of keys (or key_aliases: a list of aliases)", param="keys")
        targets = [(k, await live(_hash_of(k, "keys"), "keys")) for k in named]
        listed = await state.keys.list_async()
        for a in aliases:
            found = [k for k in listed if k.source == "database" and not k.revoked and k.spec.alias == a]
            if not found:
                raise GatewayError(404, f"key_aliases: no key with alias {a!r}", code="key_not_found",
                                   param="key_aliases")  # fmt: skip
            targets += [(a, k) for k in found]
        for _, rec in targets:
            if rec.source != "database":
                msg = "keys: a key defined in the config file; remove it there"
                raise GatewayError(400, msg, param="keys")
        for _, rec in targets:
            await state.keys.revoke_async(rec.key_hash)
        return {"deleted_keys": list(dict.fromkeys(given for given, _ in targets))}

    @r.get("/list")
    async def list_keys(
        request: Request,
        return_full_object: bool = False,
        key_alias: str | None = None,
        team_id: str | None = None,
        user_id: str | None = None,
        key_hash: str | None = None,
        status: Literal["active", "expired", "revoked"] | None = None,
        page: int = Query(1, ge=1),
        size: int = Query(10, ge=1, le=100),
    ):
        """LiteLLM's page of `size` keys (10 by default, oldest first) and its filters; its
        filters on what the gateway lacks (users, organizations, ...) are a 400 by name: ignored,
        they answered every key. Without `page`, every script that read pages until an empty
        one looped forever (each page was all the keys)."""
        state.require_master(request)
        for name in _NO_SUCH_FILTER:
            if request.query_params.get(name):
                msg = f"{name}: the kvserve gateway has no such owners (team_id=, user_id=, key_alias=)"
                raise GatewayError(400, msg, code="unsupported_parameter", param=name)
        recs = [
            k
            for k in await state.keys.list_async()
            if not k.revoked
            and (key_alias is None or k.spec.alias == key_alias)
            and (team_id is None or k.spec.team == team_id)
            and (user_id is None or k.spec.user == user_id)
            and (key_hash is None or k.key_hash == key_hash)
            and (status is None or _status(k) == status)
        ]
        pages = max(-(-len(recs) // size), 1)
        shown = recs[(page - 1) * size : page * size]
        if not return_full_object:
            keys = [k.key_hash for k in shown]
        else:
            keys = [key_info(k, await spent(k)) for k in shown]
        return {"keys": keys, "total_count": len(recs), "current_page": page, "total_pages": pages}

    return r


async def info_scope(state, request: Request, asked: str | None, what: str) -> str:
    """Whose /team/info or /user/info (`what`: "team" or "user") a caller reads: the master key
    any it names; another key only its own (none named: its own; 404 if it has none)."""
    caller = await state.authenticate(request)
    own = getattr(caller.spec, what)
    if caller.source != "master" and asked in (None, own):
        if own is None:
            raise GatewayError(404, f"{what}_id: this key belongs to no {what}", code=f"{what}_not_found",
                               param=f"{what}_id")  # fmt: skip
        return own
    if caller.source != "master":
        state.require_master(request)  # (401: another's)
    if asked is None:
        raise GatewayError(400, f"{what}_id: which {what} (?{what}_id=)", param=f"{what}_id")
    return asked
