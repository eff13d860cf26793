"""LiteLLM's team paths for reading (/team/info, /team/list) over the config's `teams`, with
LiteLLM's field names: a LiteLLM proxy user's scripts and dashboards read a team's budget,
limits, spend and keys there, and met route 404s. Teams are defined in the config file here,
so LiteLLM's /team/new, /team/update and /team/delete are not served (a 404 as before)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from kvserve.gateway.budgets import budget_period
from kvserve.gateway.config import TeamSpec
from kvserve.gateway.errors import GatewayError
from kvserve.gateway.litellm_keys import _iso, info_scope, key_info, key_spend
from kvserve.gateway.model_limits import budgets_shown


def _team(name: str, spec: TeamSpec, spend: float) -> dict:
    return {
        "team_id": name,
        "team_alias": name,
        "models": spec.models or [],
        "max_budget": spec.max_budget,
        "budget_duration": spec.budget_duration,
        "rpm_limit": spec.rpm,
        "tpm_limit": spec.tpm,
        "max_parallel_requests": spec.max_parallel_requests,
        "model_max_budget": budgets_shown(spec.model_max_budget),
        "model_rpm_limit": spec.model_rpm_limit,
        "model_tpm_limit": spec.model_tpm_limit,
        "spend": spend,
        "budget_reset_at": _iso(budget_period(spec.budget_duration, time.time())[1]),
        "blocked": False,
        "metadata": {},
    }


def litellm_team_router(state) -> APIRouter:
    """state: the app's GatewayState (keys, spend, cfg)."""
    r = APIRouter(prefix="/team")

    async def spent(team: str) -> float:
        """In the team budget's current period, as LiteLLM shows it (key_spend)."""
        since = budget_period(state.cfg.teams[team].budget_duration, time.time())[0]
        return await state.spend.spent(since, team=team)

    @r.get("/info")
    async def info(request: Request, team_id: str | None = None) -> dict:
        """The master key reads any team; another key only its own (no ?team_id: its own)."""
        team_id = await info_scope(state, request, team_id, "team")
        spec = state.cfg.teams.get(team_id)
        if spec is None:
            raise GatewayError(404, f"team_id: no team {team_id[:200]!r}", code="team_not_found",
                               param="team_id")  # fmt: skip
        keys = [k for k in await state.keys.list_async() if not k.revoked and k.spec.team == team_id]
        spends = [await key_spend(state.spend, k) for k in keys]
        return {
            "team_id": team_id,
            "team_info": _team(team_id, spec, await spent(team_id)),
            "keys": [key_info(k, s) for k, s in zip(keys, spends)],
        }

    @r.get("/list")
    async def list_teams(request: Request) -> list[dict]:
        state.require_master(request)
        return [_team(name, spec, await spent(name)) for name, spec in state.cfg.teams.items()]

    return r
