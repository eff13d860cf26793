"""Uploaded and produced files: bytes under <storage>/files/<id>, records in SQLite, in
OpenAI's File object shape. Uploads are copied chunk by chunk with a size cap. A file given an
expiration (expiry.py) is deleted, record and bytes, by the first call that meets it expired."""

from __future__ import annotations

import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import BinaryIO

from kvserve.batch.errors import BatchAPIError, not_found

PURPOSES = ("batch",)  # what may be uploaded; batch_output is what we write
CHUNK = 1 << 20


def too_large(limit: int) -> BatchAPIError:
    return BatchAPIError(
        400, f"file: larger than the server's limit of {limit} bytes", "file", "file_too_large"
    )


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    def __init__(self, conn: sqlite3.Connection, storage_dir: str | Path, max_upload_size: int) -> None:
        self.conn = conn
        self.dir = Path(storage_dir) / "files"
        self.max_upload_size = max_upload_size

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise not_found("file", file_id, "file_id")
        return self.dir / file_id

    def copy_in(self, src: BinaryIO, file_id: str, purpose: str) -> None:
        """Copy an upload in (no record yet: `register` it); over max_upload_size it is refused
        and nothing is kept."""
        if purpose not in PURPOSES:
            raise BatchAPIError(400, f"purpose: {purpose!r} is not supported here (only 'batch')", "purpose")
        dest, size = self.path(file_id), 0
        try:
            with open(dest, "wb") as f:
                while chunk := src.read(CHUNK):
                    size += len(chunk)
                    if size > self.max_upload_size:
                        raise too_large(self.max_upload_size)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def register(self, file_id: str, filename: str, purpose: str, expires_after: int | None = None) -> dict:
        """Record a file whose bytes are already in place; `expires_after`: seconds it lives."""
        size, now = self.path(file_id).stat().st_size, int(time.time())
        expires_at = None if expires_after is None else now + expires_after
        self.conn.execute(
            f"INSERT INTO files ({FIELDS}) VALUES (?, ?, ?, ?, ?, ?)",
            (file_id, size, now, filename, purpose, expires_at),
        )
        return self.get(file_id)

    def purge_expired(self) -> None:
        """Delete the files past their expires_at, as DELETE /v1/files/{id} would."""
        rows = self.conn.execute(
            "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (time.time(),)
        ).fetchall()
        for (file_id,) in rows:
            self.conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
            self.path(file_id).unlink(missing_ok=True)

    def get(self, file_id: str, param: str = "file_id") -> dict:
        self.purge_expired()
        row = self.conn.execute(f"SELECT {FIELDS} FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise not_found("file", file_id, param)
        return _file_obj(row)

    def list(
        self, purpose: str | None = None, limit: int = 10000, after: str | None = None, order: str = "desc"
    ) -> list[dict]:
        """Newest first (order "desc", OpenAI's default) or oldest first; `after` is the last id
        of the previous page (a cursor over (created_at, id), so equal times never repeat a file)."""
        self.purge_expired()
        where, args = [], []
        if purpose is not None:
            where, args = ["purpose = ?"], [purpose]
        if after is not None:
            row = self.conn.execute("SELECT created_at FROM files WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise not_found("file", after, "after")
            where.append(f"(created_at, id) {'<' if order == 'desc' else '>'} (?, ?)")
            args += [row[0], after]
        way = "DESC" if order == "desc" else "ASC"
        q = f"SELECT {FIELDS} FROM files"
        q += " WHERE " + " AND ".join(where) if where else ""
        q += f" ORDER BY created_at {way}, id {way} LIMIT ?"
        return [_file_obj(r) for r in self.conn.execute(q, (*args, limit)).fetchall()]

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        self.conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


FIELDS = "id, bytes, created_at, filename, purpose, expires_at"


def _file_obj(row) -> dict:
    file_id, size, created, filename, purpose, expires_at = row
    return {
        "id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
        "purpose": purpose, "status": "processed", "status_details": None, "expires_at": expires_at,
    }  # fmt: skip
