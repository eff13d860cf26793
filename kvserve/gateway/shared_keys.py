"""API-made keys in the state store's Redis, so every gateway instance sees them. With an
instance per host (Kubernetes pods, each its own SQLite `database`), a key made or revoked
through the admin API counted only on the instance that made it: a 401 on the others.

Each key is one field of the hash `kvgw:keys` (its SHA-256 -> {spec, created, revoked}); a
revoke keeps it as a tombstone so no instance's local copy brings it back. Updates and revokes
are Lua scripts (one round trip, no read-then-write race between instances). SQLite keeps a
local copy (keys.py): a key made before Redis held keys is copied to Redis at its first use."""

from __future__ import annotations

import json

from kvserve.gateway.state.redis_store import PREFIX, _guarded

HASH = PREFIX + "keys"

# ARGV: key hash, field (spec | revoked), new value; 1 if a live key was changed
_CHANGE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local r = cjson.decode(v)
if r.revoked ~= nil and r.revoked ~= cjson.null then return 0 end
if ARGV[2] == 'revoked' then r.revoked = tonumber(ARGV[3]) else r.spec = ARGV[3] end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
return 1
"""


class SharedKeys:
    def __init__(self, redis) -> None:
        self.redis = redis
        self._change = redis.register_script(_CHANGE)

    @_guarded
    async def get(self, key_hash: str) -> dict | None:
        """{spec (JSON text), created, revoked} or None."""
        raw = await self.redis.hget(HASH, key_hash)
        return None if raw is None else json.loads(raw)

    @_guarded
    async def put(self, key_hash: str, spec_json: str, created: float, revoked: float | None = None) -> bool:
        """Adds a key unless one with that hash is there already (then False)."""
        entry = json.dumps({"spec": spec_json, "created": created, "revoked": revoked})
        return bool(await self.redis.hsetnx(HASH, key_hash, entry))

    @_guarded
    async def update(self, key_hash: str, spec_json: str) -> bool:
        return bool(await self._change(keys=[HASH], args=[key_hash, "spec", spec_json]))

    @_guarded
    async def revoke(self, key_hash: str, when: float) -> bool:
        return bool(await self._change(keys=[HASH], args=[key_hash, "revoked", repr(when)]))

    @_guarded
    async def all(self) -> dict[str, dict]:
        return {h.decode(): json.loads(v) for h, v in (await self.redis.hgetall(HASH)).items()}
