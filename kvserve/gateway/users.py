"""Users made through LiteLLM's /user/* paths (litellm_users.py): a user owns keys (a key's
`user`), and the user's budget and limits cap all its keys together, as LiteLLM's do. Kept as the
keys are: in the gateway's SQLite database, and with a Redis state in Redis too, which every
instance reads first (users kept in Redis alone were lost with a Redis restarted without
persistence, and with them the budgets capping their keys)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field

from kvserve.gateway.config import KeySpec, UserSpec

HASH = "kvgw:users"  # (redis_store.PREFIX's; Redis is imported only when the state is Redis)
# A user made only where none is (a tombstone, a deleted user, counts as none), in one step: two
# instances making the same user at once both read "none" and both made it, the last one winning
_CREATE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and not cjson.decode(v).deleted then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


async def _redis(fn, *args):
    """A Redis call, its failure the store's (StoreUnavailable: a 503), as redis_store's are."""
    from kvserve.gateway.state.redis_store import _guarded

    return await _guarded(fn)(*args)


@dataclass
class UserRecord:
    user_id: str
    spec: UserSpec
    created: float = field(default_factory=time.time)


def _entry(rec: UserRecord) -> str:
    return json.dumps({"spec": rec.spec.model_dump(exclude_none=True), "created": rec.created})


def _record(user_id: str, raw: str | bytes) -> UserRecord:
    e = json.loads(raw)
    return UserRecord(user_id, UserSpec.model_validate(e["spec"]), e["created"])


class UserStore:
    """redis: the state store's client (None: the memory state, users in `db`)."""

    def __init__(self, db: sqlite3.Connection, redis=None) -> None:
        self.db, self.redis = db, redis
        self._create = redis.register_script(_CREATE) if redis is not None else None
        self.lock = threading.Lock()
        db.execute("CREATE TABLE IF NOT EXISTS users (user_id TEXT PRIMARY KEY, entry TEXT NOT NULL)")
        db.commit()

    def _sql(self, sql: str, args: tuple = ()) -> list:
        with self.lock:
            try:
                rows = self.db.execute(sql, args).fetchall()
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()  # else the failed write's transaction keeps the file locked
                raise
        return rows

    async def _local(self, user_id: str) -> UserRecord | None:
        rows = await asyncio.to_thread(self._sql, "SELECT entry FROM users WHERE user_id = ?", (user_id,))
        return _record(user_id, rows[0][0]) if rows else None

    async def _save_local(self, rec: UserRecord) -> None:
        sql = "INSERT OR REPLACE INTO users (user_id, entry) VALUES (?, ?)"
        await asyncio.to_thread(self._sql, sql, (rec.user_id, _entry(rec)))

    async def get(self, user_id: str) -> UserRecord | None:
        """Redis first (a tombstone: deleted, whatever a local copy says); a user Redis lost
        (restarted without persistence) is read from the database and shared again."""
        if self.redis is None:
            return await self._local(user_id)
        raw = await _redis(self.redis.hget, HASH, user_id)
        if raw is not None:
            return None if json.loads(raw).get("deleted") else _record(user_id, raw)
        rec = await self._local(user_id)
        if rec is not None:
            await _redis(self.redis.hsetnx, HASH, user_id, _entry(rec))
        return rec

    async def create(self, rec: UserRecord) -> bool:
        """False: a user with that id exists already (on any instance: decided atomically, in
        Redis with a Redis state, else by the shared database's primary key)."""
        if await self.get(rec.user_id) is not None:  # (one only a database holds is shared again)
            return False
        if self._create is not None:
            if not int(await _redis(self._create, [HASH], [rec.user_id, _entry(rec)])):
                return False
            await self._save_local(rec)
            return True
        sql = "INSERT OR IGNORE INTO users (user_id, entry) VALUES (?, ?)"
        return bool(await asyncio.to_thread(self._insert, sql, (rec.user_id, _entry(rec))))

    def _insert(self, sql: str, args: tuple) -> int:
        with self.lock:
            try:
                n = self.db.execute(sql, args).rowcount
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()
                raise
        return n

    async def replace(self, rec: UserRecord) -> None:
        if self.redis is not None:
            await _redis(self.redis.hset, HASH, rec.user_id, _entry(rec))
        await self._save_local(rec)

    async def delete(self, user_id: str) -> None:
        if self.redis is not None:  # a tombstone: no instance's local copy brings the user back
            await _redis(self.redis.hset, HASH, user_id, json.dumps({"deleted": time.time()}))
        await asyncio.to_thread(self._sql, "DELETE FROM users WHERE user_id = ?", (user_id,))

    async def all(self) -> list[UserRecord]:
        """Oldest first."""
        rows = await asyncio.to_thread(self._sql, "SELECT user_id, entry FROM users")
        recs = {k: _record(k, v) for k, v in rows}
        if self.redis is not None:
            for k, v in (await _redis(self.redis.hgetall, HASH)).items():
                deleted = json.loads(v).get("deleted")
                if deleted:
                    recs.pop(k.decode(), None)
                else:
                    recs[k.decode()] = _record(k.decode(), v)
        return sorted(recs.values(), key=lambda r: r.created)


async def user_made(users: UserStore, spec: KeySpec) -> None:
    """A key's user that names no user makes one, without limits (LiteLLM's upsert on
    /key/generate's user_id): the user's spend and keys are then read at /user/info."""
    if spec.user is not None:
        await users.create(UserRecord(spec.user, UserSpec()))  # (False: there already)
