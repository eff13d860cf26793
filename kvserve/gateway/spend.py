"""Spend log in SQLite: one row per answered request, written in batches off the event loop so
logging never adds latency; every instance sharing the file sees every row."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from dataclasses import astuple, dataclass

log = logging.getLogger("kvserve.gateway")
GROUPS = {"key": "key_hash", "team": "team", "model": "model", "deployment": "deployment"}


@dataclass
class SpendRow:
    ts: float
    request_id: str
    key_hash: str
    key_alias: str | None
    team: str | None
    model: str
    deployment: str | None
    prompt_tokens: int
    completion_tokens: int
    cost: float
    status: int
    user: str | None = None  # the key's user (LiteLLM's user_id), whose budget it counts in


class SpendLog:
    def __init__(self, db: sqlite3.Connection, flush_every: float = 0.5) -> None:
        self.db = db
        self.lock = threading.Lock()
        self.pending: list[SpendRow] = []
        self.flush_every = flush_every
        self._task: asyncio.Task | None = None
        db.execute(
            "CREATE TABLE IF NOT EXISTS spend (ts REAL, request_id TEXT, key_hash TEXT, key_alias TEXT,"
            " team TEXT, model TEXT, deployment TEXT, prompt_tokens INTEGER, completion_tokens INTEGER,"
            " cost REAL, status INTEGER, user TEXT)"
        )
        if "user" not in [c[1] for c in db.execute("PRAGMA table_info(spend)")]:  # (written before users)
            try:
                db.execute("ALTER TABLE spend ADD COLUMN user TEXT")
            except sqlite3.OperationalError as e:  # another instance starting at once added it first
                if "duplicate column" not in str(e):
                    raise
        db.execute("CREATE INDEX IF NOT EXISTS spend_ts ON spend (ts)")
        for col in ("key_hash", "team", "user"):  # a budget rebuilt (spent) reads one owner's rows
            db.execute(f"CREATE INDEX IF NOT EXISTS spend_{col}_ts ON spend ({col}, ts)")
        db.commit()

    def record(self, row: SpendRow) -> None:
        self.pending.append(row)

    def _write(self, rows: list[SpendRow]) -> None:
        with self.lock:
            try:
                self.db.executemany(
                    "INSERT INTO spend VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", [astuple(r) for r in rows]
                )
                self.db.commit()
            except sqlite3.Error:
                self.db.rollback()  # else the failed insert's transaction keeps the file locked
                raise

    async def flush(self) -> None:
        rows, self.pending = self.pending, []
        if rows:
            try:
                await asyncio.to_thread(self._write, rows)
            except sqlite3.Error:
                self.pending[:0] = rows  # kept for the next flush, not lost with this one
                raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_every)
            try:
                await self.flush()
            except sqlite3.Error as e:  # locked past the busy timeout, disk full, ...: try again later
                log.warning("spend log: writing %d rows failed (%s); retrying", len(self.pending), e)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.flush()

    async def spent(
        self,
        since: float,
        key_hash: str | None = None,
        team: str | None = None,
        user: str | None = None,
        model: str | None = None,
    ) -> float:
        """What a key (or a team, or a user) was charged from `since` on: a budget's spend rebuilt when the
        state store lost it (every instance's rows, where they share the file; this one's not
        yet written counted from memory). model: on that model group only (a key's model_max_budget)."""
        try:
            await self.flush()
        except sqlite3.Error:  # (a full disk: the rows stay pending, counted below; retried later)
            pass
        named = (("key_hash", key_hash), ("user", user), ("team", team))
        col, value = next(((c, v) for c, v in named if v is not None), ("team", team))

        def query():
            with self.lock:
                sql = f"SELECT SUM(cost) FROM spend WHERE {col} = ? AND ts >= ?"
                if model is not None:
                    return self.db.execute(sql + " AND model = ?", (value, since, model)).fetchone()[0]
                return self.db.execute(sql, (value, since)).fetchone()[0]

        written = await asyncio.to_thread(query) or 0.0
        mine = (
            r.cost
            for r in self.pending
            if getattr(r, col) == value and r.ts >= since and (model is None or r.model == model)
        )
        return float(written + sum(mine))

    async def entries(
        self,
        key_hash: str | None,
        request_id: str | None,
        start: float,
        end: float,
        limit: int,
        user: str | None = None,
    ) -> list[SpendRow]:
        """Rows from `start` to before `end`, newest first, at most `limit` (LiteLLM's /spend/logs)."""
        await self.flush()
        sql, args = "SELECT * FROM spend WHERE ts >= ? AND ts < ?", [start, end]
        for col, value in (("key_hash", key_hash), ("request_id", request_id), ("user", user)):
            if value is not None:
                sql += f" AND {col} = ?"
                args.append(value)
        sql += " ORDER BY ts DESC LIMIT ?"

        def query():
            with self.lock:
                return self.db.execute(sql, (*args, limit)).fetchall()

        return [SpendRow(*row) for row in await asyncio.to_thread(query)]

    async def report(self, group_by: str, start: float | None, end: float | None) -> list[dict]:
        await self.flush()
        col = GROUPS[group_by]
        sql = (
            f"SELECT {col}, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cost) FROM spend"
            " WHERE ts >= ? AND ts < ? GROUP BY 1 ORDER BY 5 DESC"
        )

        def query():
            with self.lock:
                return self.db.execute(sql, (start or 0.0, end or 1e18)).fetchall()

        rows = await asyncio.to_thread(query)
        return [
            {
                group_by: g,
                "requests": n,
                "prompt_tokens": p or 0,
                "completion_tokens": c or 0,
                "spend": s or 0.0,
            }
            for g, n, p, c, s in rows
        ]
