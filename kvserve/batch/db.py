"""The SQLite database beside the batch files: file records, batch records, and the lines of
a running batch already written (so a restart never repeats one)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, obj TEXT NOT NULL,
    watermark INTEGER NOT NULL DEFAULT 0, in_offset INTEGER NOT NULL DEFAULT 0,
    out_bytes INTEGER NOT NULL DEFAULT 0, err_bytes INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS done_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""


def default_storage_dir() -> str:
    """$XDG_DATA_HOME/kvserve/batch, else ~/.local/share/kvserve/batch."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvserve", "batch")


def open_db(storage_dir: str | Path) -> sqlite3.Connection:
    """WAL with synchronous=FULL: a commit survives a kill -9 and a power cut. One connection,
    used from the event loop only (every statement is a few rows)."""
    path = Path(storage_dir)
    (path / "files").mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path / "batch.sqlite3", check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(SCHEMA)
    _add_usage_columns(conn)
    if "expires_at" not in {row[1] for row in conn.execute("PRAGMA table_info(files)")}:
        conn.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")  # a database from before expiry
    return conn


USAGE_COLUMNS = ("input_tokens", "cached_tokens", "output_tokens")


def _add_usage_columns(conn: sqlite3.Connection) -> None:
    """A database written before batches counted their tokens gets the columns (zero so far)."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(batches)")}
    for name in USAGE_COLUMNS:
        if name not in have:
            conn.execute(f"ALTER TABLE batches ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0")
