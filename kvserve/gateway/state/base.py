"""The state-store contract. Every method is atomic on its own: admission checks all limits and
applies all of them, or applies none, so concurrent gateways can never over-admit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

WINDOW_S = 60  # rpm / tpm are sliding one-minute windows with one-second buckets
FAIL_WINDOW_S = 60  # allowed_fails are counted within this window
EPS = 1e-9  # float slack when comparing money


class StoreUnavailable(RuntimeError):
    """The shared state store cannot be reached: the gateway refuses (503) rather than guess."""


@dataclass(frozen=True)
class Check:
    """One limit to enforce. amount: 1 for rpm, tokens for tpm, 1 for parallel, money for budget;
    period: the budget's reset period in seconds (0: never resets)."""

    kind: Literal["rpm", "tpm", "parallel", "budget"]
    scope: str
    limit: float
    amount: float = 1
    period: float = 0


def period_index(now: float, period: float) -> int:
    """Which budget period `now` (seconds) falls in; 0 for a budget that never resets. Integer
    milliseconds, as the Lua scripts count, so both sides agree at a boundary."""
    period_ms = int(period * 1000)
    return int(now * 1000) // period_ms if period_ms > 0 else 0


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

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
