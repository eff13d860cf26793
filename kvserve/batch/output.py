"""Where a running batch's results go, one line at a time.

DurableSink (the server): lines are appended to the output / error files as they finish;
every `commit` fsyncs both files and then, in one SQLite transaction, records the new file
sizes, the lines done and the counts. A restart truncates the files back to the recorded
sizes and skips the recorded lines, so a line is never written twice nor lost. The lines done
are kept as a watermark (every line before it is done) plus the few done past it, so memory
and the table stay as small as the window, whatever the file's size.

PlainSink (`kvserve run-batch`): one output file, flushed as it goes, no resume.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import IO

# Characters that end a line for str.splitlines() (what many readers of a JSONL file split it
# with) and that json.dumps leaves raw in a string: escaped, so such a reader gets whole lines.
# A random model's text held one (tests/test_batch.py, round 40).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _line(record: dict) -> bytes:
    """One JSON line; escaped as ASCII when a lone surrogate cannot be UTF-8, so no line is lost."""
    try:
        return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS).encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record).encode() + b"\n"


def line_tokens(record: dict) -> tuple[int, int, int]:
    """(input, cached, output) tokens of a line's answer, from its body's usage (the chat,
    completions and embeddings shapes; embeddings have no output tokens; the Responses API's
    input_tokens / output_tokens)."""
    usage = ((record.get("response") or {}).get("body") or {}).get("usage") or {}
    if "input_tokens" in usage:
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return usage["input_tokens"] or 0, cached, usage.get("output_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage.get("prompt_tokens") or 0, cached, usage.get("completion_tokens") or 0


def _open_at(path: Path, size: int) -> IO[bytes]:
    f = open(path, "ab+")
    f.truncate(size)  # drop whatever was written after the last commit
    f.seek(size)
    return f


def truncate_uncommitted(path: Path, size: int) -> None:
    """Drop what was written to a batch's file after its last commit (when the file exists)."""
    try:
        with open(path, "r+b") as f:
            f.truncate(size)
    except FileNotFoundError:
        pass


class DurableSink:
    def __init__(
        self, conn: sqlite3.Connection, batch_id: str, out_path: Path, err_path: Path, resume: tuple
    ) -> None:
        """resume: JobStore.resume_point (watermark, its input offset, output and error sizes,
        lines done past the watermark)."""
        watermark, in_offset, out_bytes, err_bytes, done = resume
        self.conn = conn
        self.batch_id = batch_id
        self.out = _open_at(out_path, out_bytes)
        self.err = _open_at(err_path, err_bytes)
        self.watermark, self.in_offset = watermark, in_offset
        self.done_past: dict[int, int] = dict.fromkeys(done, -1)  # line -> offset after it (-1: unknown yet)
        self.pending: list[int] = []
        self.completed = self.failed = 0
        self.tokens = [0, 0, 0]  # input, cached, output: since the last commit

    def is_done(self, line: int) -> bool:
        return line < self.watermark or line in self.done_past

    def add(self, line: int, end_offset: int, record: dict | None, ok: bool) -> None:
        """A line is finished (record None: nothing to write: blank, or done before a restart)."""
        if record is not None:
            (self.out if ok else self.err).write(_line(record))
            self.pending.append(line)
            if ok:
                self.completed += 1
                for i, n in enumerate(line_tokens(record)):
                    self.tokens[i] += n
            else:
                self.failed += 1
        self.done_past[line] = end_offset
        while self.watermark in self.done_past:
            off = self.done_past.pop(self.watermark)
            self.in_offset = off if off >= 0 else self.in_offset
            self.watermark += 1

    def commit(self) -> None:
        if not self.pending and not self.completed and not self.failed:
            return
        for f in (self.out, self.err):
            f.flush()
            os.fsync(f.fileno())
        c = self.conn
        c.execute("BEGIN")
        try:
            c.executemany(
                "INSERT OR IGNORE INTO done_lines (batch_id, line) VALUES (?, ?)",
                [(self.batch_id, n) for n in self.pending if n >= self.watermark],
            )
            c.execute(
                "DELETE FROM done_lines WHERE batch_id = ? AND line < ?", (self.batch_id, self.watermark)
            )
            c.execute(
                "UPDATE batches SET watermark = ?, in_offset = ?, out_bytes = ?, err_bytes = ?, "
                "completed = completed + ?, failed = failed + ?, input_tokens = input_tokens + ?, "
                "cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                (self.watermark, self.in_offset, self.out.tell(), self.err.tell(),
                 self.completed, self.failed, *self.tokens, self.batch_id),
            )  # fmt: skip
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self.pending.clear()
        self.completed = self.failed = 0
        self.tokens = [0, 0, 0]

    def close(self) -> None:
        self.commit()
        self.out.close()
        self.err.close()


class PlainSink:
    """Results and error lines into one file (as vLLM's run-batch), counted for the summary."""

    def __init__(self, path: str, progress=None) -> None:
        self.f = open(path, "wb")
        self.progress = progress
        self.completed = self.failed = 0

    def is_done(self, line: int) -> bool:
        return False

    def add(self, line: int, end_offset: int, record: dict | None, ok: bool) -> None:
        if record is None:
            return
        self.f.write(_line(record))
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        if self.progress is not None:
            self.progress.update(1)

    def commit(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()
