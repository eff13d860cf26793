"""LiteLLM's spend paths over the gateway's spend log (master key): GET /spend/logs (its rows in
LiteLLM_SpendLogs' field names, or a daily summary; user_id= a user's rows), GET /global/spend,
/global/spend/keys and /global/spend/models (the top spenders). A LiteLLM proxy
user's scripts and dashboards read spend there and met route 404s (the gateway's own report is
/admin/spend). The log is this instance's SQLite file (docs/GATEWAY.md)."""

from __future__ import annotations

import datetime
import itertools

from fastapi import APIRouter, Query, Request, Response

from kvserve.gateway.errors import GatewayError
from kvserve.gateway.litellm_keys import _hash_of
from kvserve.gateway.spend import SpendRow

ROW_CAP = 10_000  # LiteLLM's: the newest rows, the answer marked truncated beyond
_DAY = datetime.timedelta(days=1)


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat()


def log_entry(row: SpendRow, backend_model: str) -> dict:
    """One row as LiteLLM's LiteLLM_SpendLogs names it: model is the backend's model,
    model_group the name clients send, model_id the deployment."""
    status = "success" if row.status == 200 else "failure"
    return {
        "request_id": row.request_id,
        "api_key": row.key_hash,
        "spend": row.cost,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "startTime": _iso(row.ts),
        "endTime": _iso(row.ts),
        "model": backend_model,
        "model_group": row.model,
        "model_id": row.deployment,
        "team_id": row.team,
        "user": row.user or "",
        "status": status,
        "metadata": {"user_api_key_alias": row.key_alias, "status": status, "status_code": row.status},
    }


def daily_summary(rows: list[SpendRow], end: datetime.date) -> list[dict]:
    """LiteLLM's summarize=true answer: per day, its spend in all, per model and per key (by
    hash), oldest first; the days after the last with spend up to end_date at 0, as LiteLLM pads."""
    day = lambda r: datetime.datetime.fromtimestamp(r.ts, datetime.UTC).date()  # noqa: E731
    out: list[dict] = []
    for d, group in itertools.groupby(sorted(rows, key=lambda r: r.ts), key=day):
        items = list(group)
        per_key: dict[str, float] = {}
        models: dict[str, float] = {}
        users: dict[str, float] = {}
        for r in items:
            per_key[r.key_hash] = per_key.get(r.key_hash, 0.0) + r.cost
            models[r.model] = models.get(r.model, 0.0) + r.cost
            if r.user is not None:
                users[r.user] = users.get(r.user, 0.0) + r.cost
        out.append({**per_key, "startTime": d.isoformat(), "spend": sum(r.cost for r in items),
                    "users": users, "models": models})  # fmt: skip
    if out:
        d = datetime.date.fromisoformat(out[-1]["startTime"]) + _DAY
        while d <= end:
            out.append({"startTime": d.isoformat(), "spend": 0, "users": {}, "models": {}})
            d += _DAY
    return out


def _date(value: str, param: str) -> datetime.date:
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        msg = f"{param}: expected a date YYYY-MM-DD, got {value[:40]!r}"
        raise GatewayError(400, msg, param=param) from None


def litellm_spend_router(state) -> APIRouter:
    """state: the app's GatewayState (spend, cfg)."""
    r = APIRouter()

    def backend_model(deployment: str | None) -> str:
        dep = next((d for d in state.cfg.model_list if d.id == deployment), None)
        return dep.backend.model if dep is not None else ""

    @r.get("/spend/logs")
    async def spend_logs(
        request: Request,
        response: Response,
        api_key: str | None = None,
        request_id: str | None = None,
        user_id: str | None = None,
        start_date: str | None = None,
        end_date: str | None = None,
        summarize: bool = True,
    ):
        """Newest first (at most ROW_CAP); with start_date and end_date (both days included),
        a daily summary unless summarize=false."""
        state.require_master(request)
        if (start_date is None) != (end_date is None):
            missing = "end_date" if end_date is None else "start_date"
            raise GatewayError(400, f"{missing}: start_date and end_date go together", param=missing)
        start, end, last = 0.0, 1e18, None
        if start_date is not None and end_date is not None:
            first, last = _date(start_date, "start_date"), _date(end_date, "end_date")
            if last < first:
                raise GatewayError(400, "end_date: before start_date", param="end_date")
            start = datetime.datetime.combine(first, datetime.time(), datetime.UTC).timestamp()
            end = datetime.datetime.combine(last + _DAY, datetime.time(), datetime.UTC).timestamp()
        key_hash = None if api_key is None else _hash_of(api_key, "api_key")
        rec = None if key_hash is None else await state.keys.record_async(key_hash)
        if rec is not None:  # a regenerated key's rows are its line's (keys.py: account)
            key_hash = rec.account
        rows = await state.spend.entries(key_hash, request_id, start, end, ROW_CAP, user_id)
        if last is not None and summarize:
            return daily_summary(rows, last)
        if len(rows) == ROW_CAP:
            response.headers["x-litellm-spend-logs-truncated"] = "true"
        return [log_entry(row, backend_model(row.deployment)) for row in rows]

    @r.get("/global/spend")
    async def global_spend(request: Request) -> dict:
        """Everything spent through the gateway (every key's, every period's); no proxy-wide budget."""
        state.require_master(request)
        rows = await state.spend.report("model", None, None)
        return {"spend": sum(row["spend"] for row in rows), "max_budget": None}

    @r.get("/global/spend/keys")
    async def global_spend_keys(request: Request, limit: int | None = Query(None, ge=1)) -> list[dict]:
        """The keys that spent most, most first (a regenerated key's line as one: its account)."""
        state.require_master(request)
        rows = (await state.spend.report("key", None, None))[:limit]
        names = {k.account: k for k in await state.keys.list_async() if not k.revoked}
        out = []
        for row in rows:
            k = names.get(row["key"])
            alias = k.spec.alias if k is not None else None
            out.append(
                {"api_key": row["key"], "total_spend": row["spend"], "key_alias": alias, "key_name": None}
            )
        return out

    @r.get("/global/spend/models")
    async def global_spend_models(request: Request, limit: int | None = Query(None, ge=1)) -> list[dict]:
        """The model groups (the names clients send) that spent most, most first."""
        state.require_master(request)
        rows = (await state.spend.report("model", None, None))[:limit]
        return [{"model": row["model"], "total_spend": row["spend"]} for row in rows]

    return r
