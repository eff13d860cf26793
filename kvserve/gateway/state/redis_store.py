"""Redis state store: every change is one Lua script (EVALSHA, one round trip), so N gateway
processes sharing one Redis admit, reserve and cool down as if they were one. Time comes from
the Redis server's clock, so instances on skewed hosts still agree."""

from __future__ import annotations

import functools
import math
import uuid
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvserve.gateway.state.base import Admission, Check, StateStore, StoreUnavailable, calendar_aligned

_HERE = Path(__file__).parent
PREFIX = "kvgw:"


def _keys(c: Check) -> list[str]:
    if c.kind == "rpm":
        return [f"{PREFIX}w:{c.scope}:rpm"]
    if c.kind == "tpm":  # the window, and when each request in it was admitted
        return [f"{PREFIX}w:{c.scope}:tpm", f"{PREFIX}ta:{c.scope}"]
    if c.kind == "parallel":
        return [f"{PREFIX}p:{c.scope}"]
    return [f"{PREFIX}b:{c.scope}", f"{PREFIX}rz:{c.scope}", f"{PREFIX}ra:{c.scope}"]


def _guarded(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"state store (Redis): {e.__class__.__name__}: {e}") from None

    return wrapper


class RedisStore(StateStore):
    def __init__(self, url: str, max_connections: int = 64) -> None:
        # A blocking pool: a burst waits for a free connection instead of failing. A pooled
        # connection to a Redis that restarted (or failed over) fails once, at its next use: that
        # command goes again on a new connection (each request met one and was a 503). Only a
        # ConnectionError, not a timeout. A connection lost after the command was sent and before
        # its reply also raises one, so the command may have run: admit and settle are sent again
        # safely because their scripts remember the request id (admit.lua, settle.lua).
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=10, socket_timeout=5, socket_connect_timeout=5,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )  # fmt: skip
        self.redis = aioredis.Redis(connection_pool=pool)
        load = lambda *names: self.redis.register_script("".join((_HERE / n).read_text() for n in names))  # noqa: E731
        self._admit, self._settle = load("period.lua", "admit.lua"), load("period.lua", "settle.lua")
        self._fail, self._seed = load("fail.lua"), load("seed.lua")

    @_guarded
    async def admit(self, request_id: str, checks: list[Check], ttl: float) -> Admission:
        if not checks:
            return Admission(True, [])
        keys = [k for c in checks for k in _keys(c)] + [f"{PREFIX}ad:{request_id}"]
        args: list = [request_id, int(ttl * 1000), len(checks)]
        for c in checks:
            args += [c.kind, repr(float(c.limit)), repr(float(c.amount)), int(c.period * 1000)]
        out = await self._admit(keys=keys, args=args)
        n = len(checks)
        if int(out[0]) == 1:  # (a memo an earlier version wrote has no resets)
            resets = [int(x) / 1000 for x in out[1 + n : 1 + 2 * n]]
            return Admission(True, [float(x) for x in out[1 : 1 + n]], reset=resets)
        if int(out[0]) == -1:
            return Admission(False, [], unseeded=int(out[1]) - 1, now=int(out[2]) / 1000)
        retry = int(out[2])  # (-1: never, a spent budget that does not reset)
        reset = [int(out[3]) / 1000] if len(out) > 3 else []
        failed = checks[int(out[1]) - 1]
        spent = float(out[4]) if len(out) > 4 and out[4] else None  # (an earlier version's memo: none)
        return Admission(False, [], failed, math.inf if retry < 0 else retry / 1000, reset=reset, spent=spent)

    @_guarded
    async def seed_budget(self, check: Check, period: int, spent: float) -> bool:
        calendar = "1" if calendar_aligned(check.period) else "0"
        out = await self._seed(keys=_keys(check)[:1], args=[period, repr(float(spent)), calendar])
        return int(out) == 1

    @_guarded
    async def settle(self, request_id: str, checks: list[Check], actual: list[float]) -> None:
        todo = [(c, a) for c, a in zip(checks, actual) if c.kind != "rpm"]
        if not todo:
            return
        keys = [k for c, _ in todo for k in _keys(c)] + [f"{PREFIX}st:{request_id}"]
        args: list = [request_id, len(todo)]
        for c, a in todo:
            args += [c.kind, repr(float(c.amount)), repr(float(a)), int(c.period * 1000)]
        await self._settle(keys=keys, args=args)

    @_guarded
    async def record_failure(self, deployment: str, allowed_fails: int, cooldown_time: float) -> bool:
        keys = [f"{PREFIX}f:{deployment}", f"{PREFIX}c:{deployment}"]
        out = await self._fail(keys=keys, args=[allowed_fails, int(cooldown_time * 1000), uuid.uuid4().hex])
        return int(out) == 1

    @_guarded
    async def cooling(self, deployments: list[str]) -> set[str]:
        if not deployments:
            return set()
        vals = await self.redis.mget([f"{PREFIX}c:{d}" for d in deployments])
        return {d for d, v in zip(deployments, vals) if v is not None}

    @_guarded
    async def cooldown_left(self, deployments: list[str]) -> float:
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in deployments:
                pipe.pttl(f"{PREFIX}c:{d}")
            left = await pipe.execute()
        return min((ms / 1000 for ms in left if ms > 0), default=0.0)

    @_guarded
    async def cache_get(self, key: str) -> bytes | None:
        return await self.redis.get(f"{PREFIX}rc:{key}")

    @_guarded
    async def cache_set(self, key: str, value: bytes, ttl: float) -> None:
        await self.redis.set(f"{PREFIX}rc:{key}", value, px=max(1, int(ttl * 1000)))

    @_guarded
    async def cache_add(self, bucket: str, entry: bytes, ttl: float, max_entries: int) -> None:
        key = f"{PREFIX}rb:{bucket}"
        async with self.redis.pipeline(transaction=True) as pipe:  # MULTI: one step for other gateways
            pipe.lpush(key, entry).ltrim(key, 0, max_entries - 1).pexpire(key, max(1, int(ttl * 1000)))
            await pipe.execute()

    @_guarded
    async def cache_entries(self, bucket: str) -> list[bytes]:
        return await self.redis.lrange(f"{PREFIX}rb:{bucket}", 0, -1)

    @_guarded
    async def claim(self, name: str, ttl: float) -> bool:
        return bool(await self.redis.set(f"{PREFIX}claim:{name}", b"1", nx=True, px=max(1, int(ttl * 1000))))

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()
