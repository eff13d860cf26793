"""A key's and a config team's per-model limits (LiteLLM's model_max_budget, model_rpm_limit,
model_tpm_limit; a user's model_max_budget): each a limit of its own, in a scope of its own per
(owner, model group), admitted with the key's other limits in one step of the state store, so every gateway
instance counts the same window and budget. An entry names a group or a model_group_alias (the
group it names)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kvserve.gateway.config import KeySpec, TeamSpec, UserSpec, parse_duration
from kvserve.gateway.state import Check

if TYPE_CHECKING:
    from kvserve.gateway.keys import KeyRecord

SEP = ":model:"  # key:<account>:model:<group>


def _entry(table: dict | None, group: str, group_of: Callable[[str], str]):
    """The entry for `group`: by its own name first, else by an alias of it."""
    if not table:
        return None
    if group in table:
        return table[group]
    return next((v for k, v in table.items() if group_of(k) == group), None)


def model_checks(
    owner_scope: str,
    spec: KeySpec | TeamSpec | UserSpec,
    group: str,
    group_of: Callable[[str], str],
    tokens: int,
    money: float,
) -> list[Check]:
    """The checks of a key's or team's (or a user's: model_max_budget alone) limits on `group`
    (none when it names no such model)."""
    scope = f"{owner_scope}{SEP}{group}"
    out = []
    rpm = _entry(getattr(spec, "model_rpm_limit", None), group, group_of)
    if rpm:
        out.append(Check("rpm", scope, rpm, model=group))
    tpm = _entry(getattr(spec, "model_tpm_limit", None), group, group_of)
    if tpm:
        out.append(Check("tpm", scope, tpm, tokens, model=group))
    budget = _entry(spec.model_max_budget, group, group_of)
    if budget is not None:
        period = parse_duration(budget.time_period) if budget.time_period else 0.0
        out.append(Check("budget", scope, budget.budget_limit, money, period, model=group))
    return out


def owner_of(check: Check) -> str:
    """Whose limit a check is: its scope without a per-model limit's model part ("user:dave")."""
    return check.scope if check.model is None else check.scope[: -len(SEP + check.model)]


def unknown_models(spec: KeySpec | UserSpec, names: list[str]) -> tuple[str, str] | None:
    """(field, model) for the first per-model limit naming a model the gateway does not serve: it
    would cap nothing, and the caller would believe it set."""
    for field in ("model_max_budget", "model_rpm_limit", "model_tpm_limit"):
        for model in getattr(spec, field, None) or {}:
            if model not in names:
                return field, model
    return None


def model_rate_refused(key_name: str, check: Check, retry: int) -> str:
    """A per-model rpm / tpm refusal in LiteLLM's words (its scripts match "Rate limit exceeded
    for model_per_key" or "model_per_team"), with the gateway's Retry-After."""
    kind = "requests" if check.kind == "rpm" else "tokens"
    owner, model = owner_of(check), check.model
    if owner.startswith("team:"):
        descriptor = f"model_per_team: {owner.removeprefix('team:')}:{model}"
    else:
        descriptor = f"model_per_key: {key_name}:{model}"
    at = datetime.fromtimestamp(time.time() + retry, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f"Rate limit exceeded for {descriptor}. Limit type: {kind}. "
        f"Current limit: {int(check.limit)}, Remaining: 0. Limit resets at: {at}; retry after {retry} s"
    )


def owner_model_checks(
    key: KeyRecord,
    group: str,
    group_of: Callable[[str], str],
    tokens: int,
    money: float,
    team: TeamSpec | None = None,
) -> list[Check]:
    """The key's per-model checks on `group`, then its team's (`team`: the key's team's spec),
    then its user's. A key's own model_max_budget for the group stands in for its team's (as
    LiteLLM's: the key's spend on it is then gated and charged on the key alone)."""
    out = model_checks(key.scope, key.spec, group, group_of, tokens, money)
    if team is not None and key.spec.team is not None:
        team_checks = model_checks(f"team:{key.spec.team}", team, group, group_of, tokens, money)
        if _entry(key.spec.model_max_budget, group, group_of) is not None:
            team_checks = [c for c in team_checks if c.kind != "budget"]
        out += team_checks
    if key.user_limits is not None:
        user_id, user = key.user_limits
        out += model_checks(f"user:{user_id}", user, group, group_of, tokens, money)
    return out


def budgets_shown(table: dict | None) -> dict:
    """model_max_budget as /key/info and /user/info show it (LiteLLM's names)."""
    return {m: b.model_dump(exclude_none=True) for m, b in (table or {}).items()}
