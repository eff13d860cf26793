"""Single-process state store. The event loop runs one coroutine at a time and no method awaits
inside, so each method is atomic without locks."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

from kvserve.gateway.state.base import (
    EPS,
    FAIL_WINDOW_S,
    WINDOW_S,
    Admission,
    Check,
    StateStore,
    period_index,
    period_start,
)

DEFAULT_CACHE_BYTES = 256 * 2**20


class MemoryStore(StateStore):
    def __init__(
        self, clock: Callable[[], float] = time.time, cache_max_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.clock = clock  # windows and budgets (tests pass their own to go past a window)
        self._windows: dict[str, dict[int, float]] = defaultdict(dict)  # scope:kind -> second -> amount
        self._tpm_at: dict[str, dict[str, int]] = defaultdict(dict)  # scope -> request -> its second
        self._slots: dict[str, dict[str, float]] = defaultdict(dict)  # scope -> request -> expiry
        self._budgets: dict[str, list[float]] = {}  # scope -> [period index, spent]
        self._seeded: set[str] = set()  # budgets given their spend from the log (a restart lost it)
        self._reserved: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)  # -> (expiry, amt)
        self._fails: dict[str, list[float]] = defaultdict(list)
        self._cool_until: dict[str, float] = {}
        # "a:" key -> (expiry, answer) and "b:" bucket -> (expiry, semantic entries), least
        # recently used first; at most cache_max_bytes of both (bounded by the TTL alone, a busy
        # gateway held every distinct answer of the last ttl, and every bucket's embeddings)
        self._cache: OrderedDict[str, tuple[float, bytes | list[bytes]]] = OrderedDict()
        self.cache_max_bytes, self._cache_bytes = cache_max_bytes, 0
        self._claims: dict[str, float] = {}  # name -> expiry (not the LRU cache: never evicted early)

    def _window_used(self, key: str, now: float) -> tuple[float, dict[int, float]]:
        buckets = self._windows[key]
        for s in [s for s in buckets if s <= int(now) - WINDOW_S]:
            del buckets[s]
        return sum(buckets.values()), buckets

    def _budget(self, scope: str, period: float, now: float) -> list[float]:
        idx = period_index(now, period)
        b = self._budgets.get(scope)
        if b is None or b[0] != idx:
            b = self._budgets[scope] = [idx, 0.0]
        return b

    def _reset(self, c: Check, now: float) -> float:
        """Seconds until the newest second counted in an rpm / tpm window has left it."""
        buckets = self._windows.get(f"{c.scope}:{c.kind}") if c.kind in ("rpm", "tpm") else None
        return max(max(buckets) + WINDOW_S - now, 0.0) if buckets else 0.0

    def _measure(self, c: Check, now: float) -> tuple[float, float]:
        """(used, retry_after seconds if this check failed)."""
        if c.kind in ("rpm", "tpm"):
            used, buckets = self._window_used(f"{c.scope}:{c.kind}", now)
            need, retry = used + c.amount - c.limit, float(WINDOW_S)
            for s in sorted(buckets):
                need -= buckets[s]
                if need <= 0:
                    retry = s + WINDOW_S - now
                    break
            return used, max(retry, 0.001)
        if c.kind == "parallel":
            slots = self._slots[c.scope]
            for rid in [r for r, exp in slots.items() if exp <= now]:
                del slots[rid]
            return len(slots), 1.0
        b = self._budget(c.scope, c.period, now)
        res = self._reserved[c.scope]
        for rid in [r for r, (exp, _) in res.items() if exp <= now]:
            del res[rid]
        retry = 1.0  # (reservations in flight: they settle, maybe for less)
        if b[1] + c.amount > c.limit * (1 + EPS):  # the spend alone: only a reset makes room
            retry = period_start(int(b[0]) + 1, c.period) - now if c.period > 0 else math.inf
        return b[1] + sum(a for _, a in res.values()), retry

    async def admit(self, request_id: str, checks: list[Check], ttl: float) -> Admission:
        now = self.clock()
        for i, c in enumerate(checks):
            if c.kind == "budget" and c.scope not in self._seeded:
                return Admission(False, [], unseeded=i, now=now)
        used = []
        for c in checks:
            u, retry = self._measure(c, now)
            if u + c.amount > c.limit * (1 + EPS):
                spent = self._budget(c.scope, c.period, now)[1] if c.kind == "budget" else None
                return Admission(False, [], c, retry, reset=[self._reset(c, now)], spent=spent)
            used.append(u)
        for c in checks:
            if c.kind in ("rpm", "tpm"):
                buckets = self._windows[f"{c.scope}:{c.kind}"]
                buckets[int(now)] = buckets.get(int(now), 0) + c.amount
                if c.kind == "tpm":
                    at = self._tpm_at[c.scope]
                    while at and next(iter(at.values())) <= int(now) - WINDOW_S:  # (never settled)
                        del at[next(iter(at))]
                    at[request_id] = int(now)
            elif c.kind == "parallel":
                self._slots[c.scope][request_id] = now + ttl
            else:
                self._reserved[c.scope][request_id] = (now + ttl, c.amount)
        resets = [self._reset(c, now) for c in checks]
        return Admission(True, [c.limit - u - c.amount for c, u in zip(checks, used)], reset=resets)

    async def seed_budget(self, check: Check, period: int, spent: float) -> bool:
        if check.scope in self._seeded:
            return False
        b = self._budgets.get(check.scope)
        held = b[1] if b is not None and b[0] == period else 0.0
        self._budgets[check.scope] = [period, max(spent, held)]
        self._seeded.add(check.scope)
        return True

    async def settle(self, request_id: str, checks: list[Check], actual: list[float]) -> None:
        now = self.clock()
        for c, a in zip(checks, actual):
            if c.kind == "tpm":  # as settle.lua: fewer tokens come off the reservation's own bucket
                buckets, delta = self._windows[f"{c.scope}:tpm"], a - c.amount
                at = self._tpm_at[c.scope].pop(request_id, None)
                if delta > 0:
                    buckets[int(now)] = buckets.get(int(now), 0) + delta
                elif delta < 0 and at is not None and at > int(now) - WINDOW_S and at in buckets:
                    buckets[at] += delta
            elif c.kind == "parallel":
                self._slots[c.scope].pop(request_id, None)
            elif c.kind == "budget":
                self._reserved[c.scope].pop(request_id, None)
                self._budget(c.scope, c.period, now)[1] += a

    async def record_failure(self, deployment: str, allowed_fails: int, cooldown_time: float) -> bool:
        now = time.monotonic()
        fails = [t for t in self._fails[deployment] if t > now - FAIL_WINDOW_S] + [now]
        if len(fails) >= allowed_fails:
            self._fails[deployment] = []
            self._cool_until[deployment] = now + cooldown_time
            return True
        self._fails[deployment] = fails
        return False

    async def cooling(self, deployments: list[str]) -> set[str]:
        now = time.monotonic()
        return {d for d in deployments if self._cool_until.get(d, 0) > now}

    async def cooldown_left(self, deployments: list[str]) -> float:
        now = time.monotonic()
        left = [self._cool_until.get(d, 0) - now for d in deployments]
        return min((x for x in left if x > 0), default=0.0)

    def _sweep(self, now: float) -> None:
        """Drop expired answers and buckets (called on every 256th store, so memory stays bounded)."""
        for k in [k for k, (exp, _) in self._cache.items() if exp <= now]:
            self._cache_bytes -= _size(self._cache.pop(k)[1])

    def _get(self, key: str) -> bytes | list[bytes] | None:
        hit = self._cache.get(key)
        if hit is None or hit[0] <= time.monotonic():
            return None
        self._cache.move_to_end(key)
        return hit[1]

    def _put(self, key: str, value: bytes | list[bytes], ttl: float) -> None:
        now = time.monotonic()
        if len(self._cache) % 256 == 0:
            self._sweep(now)
        old = self._cache.pop(key, None)
        self._cache_bytes -= _size(old[1]) if old is not None else 0
        if _size(value) > self.cache_max_bytes:
            return  # (one answer, or one bucket, bigger than the whole cache: not kept)
        self._cache[key] = (now + ttl, value)
        self._cache_bytes += _size(value)
        while self._cache_bytes > self.cache_max_bytes:  # the least recently used go
            self._cache_bytes -= _size(self._cache.popitem(last=False)[1][1])

    async def cache_get(self, key: str) -> bytes | None:
        hit = self._get("a:" + key)
        return hit if isinstance(hit, bytes) else None

    async def cache_set(self, key: str, value: bytes, ttl: float) -> None:
        self._put("a:" + key, value, ttl)

    async def cache_add(self, bucket: str, entry: bytes, ttl: float, max_entries: int) -> None:
        old = self._get("b:" + bucket)
        entries = [entry, *old] if isinstance(old, list) else [entry]
        self._put("b:" + bucket, entries[:max_entries], ttl)

    async def cache_entries(self, bucket: str) -> list[bytes]:
        entries = self._get("b:" + bucket)
        return list(entries) if isinstance(entries, list) else []

    async def claim(self, name: str, ttl: float) -> bool:
        now = time.monotonic()
        if len(self._claims) % 256 == 0:
            self._claims = {k: t for k, t in self._claims.items() if t > now}
        if self._claims.get(name, 0.0) > now:
            return False
        self._claims[name] = now + ttl
        return True


def _size(value: bytes | list[bytes]) -> int:
    return len(value) if isinstance(value, bytes) else sum(len(e) for e in value)
