"""Which limits a request is held to: its key's and team's (checked once per request) and the
chosen deployment's (checked per attempt, so a full deployment just sends us to the next)."""

from __future__ import annotations

from kvserve.gateway.config import Deployment, Limits, parse_duration
from kvserve.gateway.state import Admission, Check


def _checks(scope: str, lim: Limits, tokens: int, money: float) -> list[Check]:
    out = []
    if lim.rpm:
        out.append(Check("rpm", scope, lim.rpm))
    if lim.tpm:
        out.append(Check("tpm", scope, lim.tpm, tokens))
    if lim.max_parallel_requests:
        out.append(Check("parallel", scope, lim.max_parallel_requests))
    if lim.max_budget is not None:
        period = parse_duration(lim.budget_duration) if lim.budget_duration else 0.0
        out.append(Check("budget", scope, lim.max_budget, money, period))
    return out


def tenant_checks(
    key_scope: str,
    key: Limits,
    team_name: str | None,
    team: Limits | None,
    tokens: int,
    money: float,
    user: tuple[str, Limits] | None = None,
) -> list[Check]:
    """user: (id, limits) of the user owning the key (KeyRecord.user_limits): they cap all its keys."""
    checks = _checks(key_scope, key, tokens, money)
    if team_name and team:
        checks += _checks(f"team:{team_name}", team, tokens, money)
    if user is not None:
        checks += _checks(f"user:{user[0]}", user[1], tokens, money)
    return checks


def deployment_checks(dep: Deployment, tokens: int) -> list[Check]:
    b = dep.backend
    lim = Limits(rpm=b.rpm, tpm=b.tpm, max_parallel_requests=b.max_parallel_requests)
    return _checks(f"dep:{dep.id}", lim, tokens, 0.0)


def needs_tokens(checks: list[Check]) -> bool:
    return any(c.kind in ("tpm", "budget") for c in checks)


def ratelimit_headers(checks: list[Check], adm: Admission) -> dict[str, str]:
    """x-ratelimit-* for the tightest key/team window (OpenAI's header names). A refused
    request reports only the window that refused it (at 0): the others were not measured.
    x-ratelimit-reset-*: until that window is back to its initial state (nothing counted in
    it), in OpenAI's format; a refused request's Retry-After says when it would be admitted."""
    h: dict[str, str] = {}
    for i, c in enumerate(checks):
        if c.kind not in ("rpm", "tpm") or (not adm.ok and c is not adm.failed):
            continue
        name = "requests" if c.kind == "rpm" else "tokens"
        remaining = max(int(adm.remaining[i]), 0) if adm.ok else 0
        if adm.ok and f"x-ratelimit-remaining-{name}" in h:
            if remaining >= int(h[f"x-ratelimit-remaining-{name}"]):
                continue
        h[f"x-ratelimit-limit-{name}"] = str(int(c.limit))
        h[f"x-ratelimit-remaining-{name}"] = str(remaining)
        reset = (adm.reset[i] if adm.ok else adm.reset[0]) if adm.reset else None
        if reset is not None:
            h[f"x-ratelimit-reset-{name}"] = duration(reset)
    return h


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format, to the millisecond: "12ms", "1s", "59.5s", "1m0s"."""
    ms = max(round(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{secs}s"
