"""Virtual keys. Only a key's SHA-256 is kept (config keys are hashed at load; keys made through
the admin API are shown once and stored hashed in SQLite, and with a Redis state in Redis too,
which every instance reads first: shared_keys.py).

SQLite calls block: the routes use the async methods, which run them in a worker thread, so a
slow disk or a database another instance holds locked never stalls the event loop (every other
request). Each call reads the file, so a key made or revoked on any instance counts at once."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.gateway.config import GatewayConfig, KeySpec, UserSpec

if TYPE_CHECKING:  # (Redis is imported only when the state is Redis)
    from kvserve.gateway.shared_keys import SharedKeys
    from kvserve.gateway.users import UserStore


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class KeyRecord:
    key_hash: str
    spec: KeySpec
    source: str  # "config" | "database" | "master"
    created: float = field(default_factory=time.time)
    revoked: float | None = None
    owner: UserSpec | None = None  # its user's, read with it (KeyStore.record_async); not stored

    @property
    def user_limits(self) -> tuple[str, UserSpec] | None:
        """(user id, the user's limits) for a key a user owns, as limits.tenant_checks takes them."""
        return None if self.spec.user is None or self.owner is None else (self.spec.user, self.owner)

    @property
    def account(self) -> str:
        """Whose budget, limits and spend these are: the first key of a regenerated line."""
        return self.spec.account or self.key_hash

    @property
    def scope(self) -> str:
        return f"key:{self.account[:24]}"

    @property
    def name(self) -> str:
        return self.spec.alias or self.key_hash[:12]

    @property
    def expired(self) -> bool:
        return self.spec.expires is not None and time.time() >= self.spec.expires

    def public(self) -> dict:
        shown = {"key", "key_hash", "alias", "models", "team", "user", "metadata", "expires", "blocked"}
        shown.add("account")
        limits = self.spec.model_dump(exclude=shown)  # (the rest: limits)
        return {
            "key_hash": self.key_hash,
            "alias": self.spec.alias,
            "models": self.spec.models,
            "team": self.spec.team,
            "user": self.spec.user,
            "metadata": self.spec.metadata,
            "expires": self.spec.expires,
            "blocked": bool(self.spec.blocked),
            "limits": limits,
            "source": self.source,
            "created": self.created,
            "revoked": self.revoked,
        }


class KeyStore:
    def __init__(self, cfg: GatewayConfig, db: sqlite3.Connection, shared: SharedKeys | None = None) -> None:
        """shared: the state store's Redis (keys every instance sees), when the state is Redis."""
        self.db, self.shared = db, shared
        self.lock = threading.Lock()  # one connection, used from worker threads in turn
        db.execute(
            "CREATE TABLE IF NOT EXISTS keys (key_hash TEXT PRIMARY KEY, spec TEXT NOT NULL,"
            " created REAL NOT NULL, revoked REAL)"
        )
        db.commit()
        self.config_keys: dict[str, KeyRecord] = {}
        for spec in cfg.keys:
            h = spec.key_hash or hash_key(spec.key or "")
            self.config_keys[h] = KeyRecord(h, spec.model_copy(update={"key": None, "key_hash": h}), "config")
        master = cfg.general_settings.master_key
        self.master_hash = hash_key(master) if master else None
        self.users: UserStore | None = None  # (set by the app: a key's user read with it)

    def _known(self, h: str) -> KeyRecord | None:
        """The master key's or a config key's record (no database involved)."""
        if h == self.master_hash:
            return KeyRecord(h, KeySpec(alias="master"), "master")
        return self.config_keys.get(h)

    def _stored(self, h: str) -> KeyRecord | None:
        with self.lock:
            row = self.db.execute(
                "SELECT spec, created, revoked FROM keys WHERE key_hash = ?", (h,)
            ).fetchone()
        if row is None or row[2] is not None:
            return None
        return KeyRecord(h, KeySpec.model_validate_json(row[0]), "database", row[1])

    def lookup(self, key: str) -> KeyRecord | None:
        """The live record for a presented key, or None (unknown, revoked or expired)."""
        return _live(self.record(hash_key(key)))

    def record(self, key_hash: str) -> KeyRecord | None:
        """The record of a key's hash, expired or not (None: unknown or revoked)."""
        return self._known(key_hash) or self._stored(key_hash)

    async def find(self, key: str) -> KeyRecord | None:
        """lookup() for the event loop: the database is read in a worker thread; with `shared`,
        Redis first (a key made or revoked on any instance)."""
        return _live(await self.record_async(hash_key(key)))

    async def record_async(self, key_hash: str) -> KeyRecord | None:
        rec = self._known(key_hash) or await self._shared_or_stored(key_hash)
        if rec is not None and rec.spec.user is not None and self.users is not None:
            user = await self.users.get(rec.spec.user)  # (deleted: its keys were deleted with it)
            rec.owner = user.spec if user is not None else None
        return rec

    async def _shared_or_stored(self, h: str) -> KeyRecord | None:
        if self.shared is None:
            return await _off_loop(self._stored, h)
        entry = await self.shared.get(h)
        if entry is not None:  # (a tombstone: revoked, whatever a local copy says)
            if entry["revoked"] is not None:
                return None
            return KeyRecord(h, KeySpec.model_validate_json(entry["spec"]), "database", entry["created"])
        rec = await _off_loop(self._stored, h)
        if rec is not None:  # made before Redis held keys (or Redis lost them): shared from now on
            await self.shared.put(h, _spec_json(rec.spec), rec.created)
        return rec

    def create(self, spec: KeySpec) -> tuple[str, KeyRecord]:
        key = "sk-kvgw-" + secrets.token_urlsafe(24)
        rec = KeyRecord(hash_key(key), spec.model_copy(update={"key": None, "key_hash": None}), "database")
        with self.lock:
            try:
                self.db.execute(
                    "INSERT INTO keys (key_hash, spec, created) VALUES (?, ?, ?)",
                    (rec.key_hash, rec.spec.model_dump_json(exclude_none=True), rec.created),
                )
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()  # else the failed write's transaction keeps the file locked
                raise
        return key, rec

    async def create_async(self, spec: KeySpec) -> tuple[str, KeyRecord]:
        key, rec = await _off_loop(self.create, spec)
        if self.shared is not None:
            try:
                await self.shared.put(rec.key_hash, _spec_json(rec.spec), rec.created)
            except BaseException:
                await _off_loop(self.revoke, rec.key_hash)  # not made at all: not on one instance only
                raise
        return key, rec

    def update(self, key_hash: str, spec: KeySpec) -> bool:
        """Replace a live API-made key's spec (False: no such live key)."""
        spec = spec.model_copy(update={"key": None, "key_hash": None})
        with self.lock:
            try:
                cur = self.db.execute(
                    "UPDATE keys SET spec = ? WHERE key_hash = ? AND revoked IS NULL",
                    (spec.model_dump_json(exclude_none=True), key_hash),
                )
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()
                raise
        return cur.rowcount == 1

    async def update_async(self, key_hash: str, spec: KeySpec) -> bool:
        spec = spec.model_copy(update={"key": None, "key_hash": None})
        shared = self.shared is not None and await self.shared.update(key_hash, _spec_json(spec))
        return await _off_loop(self.update, key_hash, spec) or shared

    def revoke(self, key_hash: str) -> bool:
        with self.lock:
            try:
                cur = self.db.execute(
                    "UPDATE keys SET revoked = ? WHERE key_hash = ? AND revoked IS NULL",
                    (time.time(), key_hash),
                )
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()
                raise
        return cur.rowcount == 1

    async def revoke_async(self, key_hash: str) -> bool:
        shared = self.shared is not None and await self.shared.revoke(key_hash, time.time())
        return await _off_loop(self.revoke, key_hash) or shared

    def list(self) -> list[KeyRecord]:
        with self.lock:
            rows = self.db.execute(
                "SELECT key_hash, spec, created, revoked FROM keys ORDER BY created"
            ).fetchall()
        db_keys = [KeyRecord(h, KeySpec.model_validate_json(s), "database", c, r) for h, s, c, r in rows]
        return [*self.config_keys.values(), *db_keys]

    async def list_async(self) -> list[KeyRecord]:
        """Every instance's keys with `shared` (Redis's entry wins over a local copy)."""
        local = await _off_loop(self.list)
        if self.shared is None:
            return local
        entries = await self.shared.all()
        recs = [k for k in local if k.source != "database" or k.key_hash not in entries]
        for h, e in sorted(entries.items(), key=lambda kv: kv[1]["created"]):
            recs.append(
                KeyRecord(h, KeySpec.model_validate_json(e["spec"]), "database", e["created"], e["revoked"])
            )
        return recs


def _spec_json(spec: KeySpec) -> str:
    return spec.model_dump_json(exclude_none=True)


def expired_words(rec: KeyRecord) -> str:
    """An expired key's refusal in LiteLLM's words, with when it expired (ISO 8601, UTC)."""
    at = datetime.datetime.fromtimestamp(rec.spec.expires or 0.0, datetime.UTC).isoformat()
    now = datetime.datetime.fromtimestamp(time.time(), datetime.UTC).isoformat()
    return f"Authentication Error - Expired Key. Key Expiry time {at} and current time {now}"


def _live(rec: KeyRecord | None) -> KeyRecord | None:
    return None if rec is None or rec.expired else rec


async def _off_loop(fn, *args):
    """fn(*args) in a worker thread (a database failure propagates: the app's 500)."""
    return await asyncio.to_thread(fn, *args)


def open_database(path: str) -> sqlite3.Connection:
    """One SQLite file shared by every instance (WAL: readers never block the writer)."""
    db = sqlite3.connect(path, check_same_thread=False, timeout=10, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA busy_timeout=10000")
    db.isolation_level = ""  # back to implicit transactions, committed explicitly
    return db


def spec_from_json(data: dict) -> KeySpec:
    """Admin API body -> KeySpec (a client-supplied key or hash is not accepted)."""
    data = {k: v for k, v in data.items() if k not in ("key", "key_hash")}
    return KeySpec.model_validate_json(json.dumps(data))
