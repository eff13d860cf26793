"""Batch records in OpenAI's Batch shape, kept in SQLite with the runner's resume point.

Statuses: validating -> in_progress -> finalizing -> completed, or failed, or
cancelling -> cancelled, or expired; each state change stamps its `<state>_at` field.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time

from kvserve.batch.errors import BatchAPIError, not_found
from kvserve.batch.files import new_file_id

# as OpenAI batches them (the first: run-batch's default)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")


def check_metadata(metadata) -> None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise BatchAPIError(400, "metadata: at most 16 key-value pairs", "metadata")
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise BatchAPIError(
                400, "metadata: keys up to 64 and string values up to 512 characters", "metadata"
            )


class JobStore:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def create(
        self, input_file_id: str, endpoint: str, window: str, metadata: dict | None,
        output_expires_after: int | None = None,
    ) -> dict:  # fmt: skip
        """output_expires_after: the seconds its output and error files live once written."""
        if endpoint not in ENDPOINTS:
            raise BatchAPIError(
                400, f"endpoint: {endpoint!r} is not served in batches here (one of {', '.join(ENDPOINTS)})",
                "endpoint", code="unsupported_endpoint",
            )  # fmt: skip
        if window not in WINDOWS:
            raise BatchAPIError(400, f"completion_window: {window!r} is not supported (only '24h')",
                                "completion_window")  # fmt: skip
        check_metadata(metadata)
        now = int(time.time())
        batch_id = "batch_" + secrets.token_hex(12)
        obj = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + WINDOWS[window], "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": batch_usage(0, 0, 0), "metadata": metadata,
            "model": None,  # the lines' model, known once the validating pass has read them
            # where the runner writes, registered as files once the batch is final
            "_output_path_id": new_file_id(), "_error_path_id": new_file_id(),
            "_output_expires_after": output_expires_after,
        }  # fmt: skip
        self.conn.execute(
            "INSERT INTO batches (id, created_at, obj) VALUES (?, ?, ?)", (batch_id, now, json.dumps(obj))
        )
        return public(obj)

    def raw(self, batch_id: str) -> dict:
        row = self.conn.execute(f"SELECT {COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise not_found("batch", batch_id, "batch_id")
        return _merge(row)

    def get(self, batch_id: str) -> dict:
        return public(self.raw(batch_id))

    def list(self, limit: int = 20, after: str | None = None) -> list[dict]:
        q, args = f"SELECT {COLUMNS} FROM batches", ()
        if after is not None:
            try:
                created = self.raw(after)["created_at"]
            except BatchAPIError:
                raise not_found("batch", after, "after") from None
            q, args = q + " WHERE (created_at, id) < (?, ?)", (created, after)
        rows = self.conn.execute(q + " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit)).fetchall()
        return [public(_merge(r)) for r in rows]

    def active_ids(self) -> list[str]:
        """Batches a restarted server must pick up, oldest first."""
        rows = self.conn.execute("SELECT id, obj FROM batches ORDER BY created_at, id").fetchall()
        return [i for i, obj in rows if json.loads(obj)["status"] in ACTIVE]

    def save(self, obj: dict) -> None:
        """The object's fields; the counts and the resume point are the runner's (columns)."""
        self.conn.execute("UPDATE batches SET obj = ? WHERE id = ?", (json.dumps(obj), obj["id"]))

    def set_total(self, batch_id: str, total: int) -> None:
        self.conn.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    def set_status(self, obj: dict, status: str, **fields) -> dict:
        obj.update(fields, status=status)
        obj[f"{status}_at"] = int(time.time())
        self.save(obj)
        return obj

    def resume_point(self, batch_id: str) -> tuple[int, int, int, int, set[int]]:
        """(watermark line, its byte offset, output bytes, error bytes, done lines past it)."""
        wm, off, out_b, err_b = self.conn.execute(
            "SELECT watermark, in_offset, out_bytes, err_bytes FROM batches WHERE id = ?", (batch_id,)
        ).fetchone()
        rows = self.conn.execute("SELECT line FROM done_lines WHERE batch_id = ?", (batch_id,)).fetchall()
        return wm, off, out_b, err_b, {r[0] for r in rows}


COLUMNS = "obj, total, completed, failed, input_tokens, cached_tokens, output_tokens"


def _merge(row) -> dict:
    obj = json.loads(row[0])
    obj["request_counts"] = {"total": row[1], "completed": row[2], "failed": row[3]}
    obj["usage"] = batch_usage(*row[4:7])
    return obj


def batch_usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """OpenAI's Batch `usage`: the tokens of the lines that succeeded so far (no reasoning tokens)."""
    return {
        "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }  # fmt: skip


def public(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if not k.startswith("_")}
