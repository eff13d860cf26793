"""The state-store contract. Every method is atomic on its own: admission checks all limits and
applies all of them, or applies none, so concurrent gateways can never over-admit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Literal

WINDOW_S = 60  # rpm / tpm are sliding one-minute windows with one-second buckets
FAIL_WINDOW_S = 60  # allowed_fails are counted within this window
EPS = 1e-9  # float slack when comparing money


class StoreUnavailable(RuntimeError):
    """The shared state store cannot be reached: the gateway refuses (503) rather than guess."""


@dataclass(frozen=True)
class Check:
    """One limit to enforce. amount: 1 for rpm, tokens for tpm, 1 for parallel, money for budget;
    period: the budget's reset period in seconds (0: never resets); model: the model group of a
    per-model limit (model_limits.py; its scope's owner part may hold any text, a user id)."""

    kind: Literal["rpm", "tpm", "parallel", "budget"]
    scope: str
    limit: float
    amount: float = 1
    period: float = 0
    model: str | None = None


_DAY_MS = 86_400_000
_WEEK_MS = 7 * _DAY_MS
_MONTH_MS = 30 * _DAY_MS  # a `30d` budget: calendar months
_MONDAY_MS = 3 * _DAY_MS  # 1970-01-01 was a Thursday: weeks count from Monday 1969-12-29


def calendar_aligned(period: float) -> bool:
    """A period that resets on LiteLLM's calendar boundaries: `30d` on the 1st of each month,
    `7d` (and any number of whole weeks) on Mondays, at 00:00 UTC. Budgets of earlier versions
    counted these from the Unix epoch (`7d` on Thursdays, `30d` every 30 days from 1970)."""
    p = int(period * 1000)
    return p > 0 and (p == _MONTH_MS or p % _WEEK_MS == 0)


def period_index(now: float, period: float) -> int:
    """Which budget period `now` (seconds) falls in; 0 for a budget that never resets. Integer
    milliseconds, as the Lua scripts count (period.lua), so both sides agree at a boundary.
    Other periods are windows from the Unix epoch: `1d` at 00:00 UTC, `1h` on the hour."""
    p, ms = int(period * 1000), int(now * 1000)
    if p <= 0:
        return 0
    if p == _MONTH_MS:
        d = date(1970, 1, 1) + timedelta(days=ms // _DAY_MS)
        return (d.year - 1970) * 12 + d.month - 1
    if p % _WEEK_MS == 0:
        return (ms + _MONDAY_MS) // p
    return ms // p


def period_start(index: int, period: float) -> float:
    """When period `index` begins (seconds since the epoch); 0 for a budget that never resets."""
    p = int(period * 1000)
    if p <= 0:
        return 0.0
    if p == _MONTH_MS:
        y, m = divmod(index, 12)
        return datetime(1970 + y, m + 1, 1, tzinfo=UTC).timestamp()
    if p % _WEEK_MS == 0:
        return (index * p - _MONDAY_MS) / 1000
    return index * p / 1000


@dataclass
class Admission:
    ok: bool
    remaining: list[float]  # per check, after this request (when ok)
    failed: Check | None = None
    # seconds (when not ok); inf: never, a budget without budget_duration whose spend alone
    # leaves no room for this request (only raising the budget would admit it)
    retry_after: float = 0.0
    # not ok, nothing applied: checks[unseeded] is a budget whose spend the store does not hold
    # (a fresh store, or Redis restarted without persistence): seed_budget it, then admit again
    unseeded: int | None = None
    now: float = 0.0  # the store's clock (seconds) when unseeded was found
    # rpm / tpm: seconds until the window holds nothing of what it counts (its state with no
    # traffic: OpenAI's x-ratelimit-reset-*); per check when ok, else the refusing window's alone
    reset: list[float] = field(default_factory=list)
    # a refused budget's spend in its period, reservations in flight left out (LiteLLM's
    # "Current cost" in its message); None for other checks
    spent: float | None = None


class StateStore:
    async def admit(self, request_id: str, checks: list[Check], ttl: float) -> Admission:
        """Admit against every check or none; parallel slots and budget reservations expire after
        ttl seconds so a gateway that dies mid-request leaks nothing for long."""
        raise NotImplementedError

    async def seed_budget(self, check: Check, period: int, spent: float) -> bool:
        """Give a budget the spend the store did not hold (rebuilt from the spend log) for period
        index `period`; what it holds for that period already (a request settled since) counts
        if larger. False when another gateway seeded it first (nothing changed)."""
        raise NotImplementedError

    async def settle(self, request_id: str, checks: list[Check], actual: list[float]) -> None:
        """Release parallel slots, turn budget reservations into spend (actual money; 0 on
        failure) and correct tpm by actual - reserved tokens."""
        raise NotImplementedError

    async def record_failure(self, deployment: str, allowed_fails: int, cooldown_time: float) -> bool:
        """Count a failure; True when this one put the deployment into cooldown."""
        raise NotImplementedError

    async def cooling(self, deployments: list[str]) -> set[str]:
        """The deployments among these that are cooling down now."""
        raise NotImplementedError

    async def cooldown_left(self, deployments: list[str]) -> float:
        """Seconds until the first of these that is cooling down comes back (0: none is)."""
        raise NotImplementedError

    # ---- the response cache (kvserve/gateway/response_cache.py) ----------------------------
    async def cache_get(self, key: str) -> bytes | None:
        """A cached answer, or None (absent or past its TTL)."""
        raise NotImplementedError

    async def cache_set(self, key: str, value: bytes, ttl: float) -> None:
        raise NotImplementedError

    async def cache_add(self, bucket: str, entry: bytes, ttl: float, max_entries: int) -> None:
        """Prepend an entry to a bucket, keep the newest max_entries, expire the bucket after ttl
        without additions (its entries' answers expire on their own)."""
        raise NotImplementedError

    async def cache_entries(self, bucket: str) -> list[bytes]:
        """A bucket's entries, newest first."""
        raise NotImplementedError

    async def claim(self, name: str, ttl: float) -> bool:
        """True for the first caller (on any instance) to claim `name` within ttl seconds: work
        done once however many gateways see the occasion (a finished batch charged)."""
        raise NotImplementedError

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
