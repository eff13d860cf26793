"""The batch line runner's bookkeeping, without the engine: whatever a line's handler does,
the line ends as exactly one output or error line, and the counts and the resume point add up."""

from __future__ import annotations

import asyncio
import json
import logging

from kvserve.batch.db import open_db
from kvserve.batch.jobs import JobStore
from kvserve.batch.lines import sequences
from kvserve.batch.output import DurableSink
from kvserve.batch.runner import LineRunner

CHAT = "/v1/chat/completions"


def _line(custom_id: str, content: str) -> str:
    body = {"messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


async def _execute(endpoint: str, body: dict, request_id: str) -> tuple[int, dict]:
    """Stands in for execute_line: a line with a bug in its path raises what we did not expect."""
    if body["messages"][0]["content"] == "boom":
        raise TypeError("unsupported operand type(s)")
    return 200, {"object": "chat.completion"}


def test_a_line_whose_handler_raises_becomes_an_internal_error_line(tmp_path, caplog):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("a", "hi"), _line("b", "boom"), _line("c", "hi")]) + "\n")
    conn = open_db(tmp_path / "store")
    jobs = JobStore(conn)
    batch_id = jobs.create("file-x", CHAT, "24h", None)["id"]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    sink = DurableSink(conn, batch_id, out, err, jobs.resume_point(batch_id))
    runner = LineRunner(CHAT, _execute, sink, window=2, should_stop=lambda: False, request_prefix=batch_id)
    with caplog.at_level(logging.ERROR, logger="kvserve.batch"):
        assert asyncio.run(runner.run(str(src)))
    sink.close()
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "c"]
    (bad,) = [json.loads(x) for x in err.read_text().splitlines()]
    assert bad["custom_id"] == "b" and bad["response"]["status_code"] == 500
    error = bad["response"]["body"]["error"]
    assert error["code"] == "internal_error" and "TypeError" in error["message"]
    counts = jobs.raw(batch_id)["request_counts"]
    assert (counts["completed"], counts["failed"]) == (2, 1)
    assert jobs.resume_point(batch_id)[0] == 3  # the watermark passed every line
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "line 1" in logged[0].getMessage()  # once, with the stack trace


def test_one_lone_surrogate_check_for_prompts_and_custom_ids():
    """The check the API (prompt / messages) and batch lines (custom_id) share: where the first
    lone surrogate is, None when the text is UTF-8 (astral characters are not surrogates)."""
    import pytest

    from kvserve.batch.lines import LineError, parse_line
    from kvserve.tokenizer import lone_surrogate

    assert lone_surrogate("ok 🙂 é") is None and lone_surrogate("ab\udc00c\ud800") == 2
    with pytest.raises(LineError, match="custom_id: must be valid Unicode") as e:
        parse_line(_line("x-\ud800", "hi").encode(), CHAT)
    assert e.value.code == "invalid_custom_id"


def test_an_output_line_is_one_line_for_splitlines():
    """A model's text may hold U+2028, U+2029 or U+0085, which json.dumps leaves raw and
    str.splitlines() (how many readers split a JSONL file) ends a line at: a random model's
    answer once cut an output line in two (tests/test_batch.py). They are written escaped."""
    from kvserve.batch.output import _line

    record = {"custom_id": "a", "response": {"body": {"content": "x\u2028y\u2029z\x85w é"}}}
    text = _line(record).decode()
    assert text.endswith("\n") and len(text.splitlines()) == 1
    assert json.loads(text) == record and "é" in text  # the rest still UTF-8, not escaped


def test_the_window_counts_engine_requests_not_lines(tmp_path):
    """A line weighs what it fans out to (prompts x max(n, best_of)): with a window of 8, lines
    of n=8 once ran 8 at a time, 64 engine requests in flight; now one at a time."""
    lines = [json.dumps({"custom_id": f"n{i}", "method": "POST", "url": CHAT,
                         "body": {"messages": [{"role": "user", "content": "hi"}], "n": 8 if i % 2 else 1,
                                  **({"best_of": 3} if i % 3 == 0 else {})}})
             for i in range(12)]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    conn = open_db(tmp_path / "store")
    jobs = JobStore(conn)
    batch_id = jobs.create("file-x", CHAT, "24h", None)["id"]
    sink = DurableSink(
        conn, batch_id, tmp_path / "out.jsonl", tmp_path / "err.jsonl", jobs.resume_point(batch_id)
    )
    in_flight, most = 0, 0

    async def execute(endpoint: str, body: dict, request_id: str) -> tuple[int, dict]:
        nonlocal in_flight, most
        weight = max(body.get("n", 1), body.get("best_of", 1))
        in_flight += weight
        most = max(most, in_flight)
        for _ in range(3):  # the other lines' tasks run meanwhile
            await asyncio.sleep(0)
        in_flight -= weight
        return 200, {"object": "chat.completion"}

    runner = LineRunner(CHAT, execute, sink, window=8, should_stop=lambda: False, request_prefix=batch_id)
    assert asyncio.run(runner.run(str(src)))
    sink.close()
    assert most == 8 and jobs.raw(batch_id)["request_counts"]["completed"] == 12
    assert sequences({"prompt": ["a", "b", "c"], "n": 2}) == 6 and sequences({"prompt": [5, 6]}) == 1
    assert (
        sequences({"prompt": [[5], [6]], "best_of": 4}) == 8 and sequences({"n": "8", "best_of": True}) == 1
    )


def test_a_line_body_the_schema_refuses_names_the_path_as_http_does():
    """A batch line's validation error named only its top-level field ("messages: Field
    required"); it names the path, as the HTTP handler does, before the engine is involved."""
    from kvserve.batch.execute import execute_line

    body = {"messages": [{"role": "user", "content": "hi"}, {"content": "x"}]}
    status, resp = asyncio.run(execute_line(None, CHAT, body, "r-1"))
    assert status == 400 and resp["error"]["param"] == "messages"
    assert resp["error"]["message"] == "messages[1].role: Field required"


def test_a_database_written_before_batches_counted_tokens_gets_the_columns(tmp_path):
    """open_db adds the usage columns to an older database (its batches count from zero)."""
    import sqlite3

    from kvserve.batch.db import open_db
    from kvserve.batch.jobs import JobStore

    (tmp_path / "files").mkdir()
    old = sqlite3.connect(tmp_path / "batch.sqlite3")
    old.executescript(
        "CREATE TABLE batches (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, obj TEXT NOT NULL, "
        "watermark INTEGER NOT NULL DEFAULT 0, in_offset INTEGER NOT NULL DEFAULT 0, "
        "out_bytes INTEGER NOT NULL DEFAULT 0, err_bytes INTEGER NOT NULL DEFAULT 0, "
        "total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, "
        "failed INTEGER NOT NULL DEFAULT 0);"
        """INSERT INTO batches (id, created_at, obj) VALUES ('batch_1', 1, '{"id": "batch_1"}');"""
    )
    old.commit()
    old.close()
    batch = JobStore(open_db(tmp_path)).get("batch_1")
    assert batch["usage"]["input_tokens"] == batch["usage"]["total_tokens"] == 0


def test_a_background_response_line_is_refused_in_batch_terms():
    """A /v1/responses line with background: true was refused with HTTP's advice, "use
    stream=true", which a batch refuses too: the message now says what a batch line should do."""
    import pytest

    from kvserve.batch.lines import LineError, parse_line

    body = {"input": "hi", "background": True}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": body})
    with pytest.raises(LineError, match="body.background: a batch line already runs in the background") as e:
        parse_line(line.encode(), "/v1/responses")
    assert "stream" not in str(e.value) and e.value.code == "invalid_body"
    assert parse_line(line.replace("true", "false").encode(), "/v1/responses")[0] == "a"


def test_lines_not_done_when_the_window_ends_become_batch_expired_error_lines(tmp_path):
    """As OpenAI: an expired batch keeps the lines it finished, and writes each line it did not
    reach to the error file (code batch_expired, its custom_id), so the counts add up."""
    from types import SimpleNamespace

    from kvserve.batch.files import FileStore
    from kvserve.batch.service import BatchService

    conn = open_db(tmp_path)
    files, jobs = FileStore(conn, tmp_path, 2**20), JobStore(conn)
    lines = [_line(f"c{i}", "hi") + "\n" for i in range(5)]
    (files.dir / "file-in").write_text("".join(lines) + "\n")
    files.register("file-in", "in.jsonl", "batch")
    obj = jobs.raw(jobs.create("file-in", CHAT, "24h", None)["id"])
    jobs.set_total(obj["id"], 5)
    obj = jobs.set_status(obj, "in_progress")
    sink = DurableSink(conn, obj["id"], files.path(obj["_output_path_id"]), files.path(obj["_error_path_id"]),
                       jobs.resume_point(obj["id"]))  # fmt: skip
    for line in (0, 2):  # finished before the window ended
        end = sum(len(x) for x in lines[: line + 1])
        sink.add(line, end, {"custom_id": f"c{line}", "response": {"status_code": 200}}, True)
    sink.close()
    jobs.save({**obj, "expires_at": obj["created_at"] - 1})
    service = BatchService(files, jobs, SimpleNamespace(model_names=["tiny"]), window=4)
    asyncio.run(service._process(obj["id"]))
    b = jobs.get(obj["id"])
    assert b["status"] == "expired" and b["expired_at"] is not None
    assert b["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    expired = [json.loads(x) for x in files.path(b["error_file_id"]).read_text().splitlines()]
    assert [e["custom_id"] for e in expired] == ["c1", "c3", "c4"]
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in expired)
    done = [json.loads(x)["custom_id"] for x in files.path(b["output_file_id"]).read_text().splitlines()]
    assert done == ["c0", "c2"]


def test_a_file_whose_bytes_are_gone_is_a_404_not_a_500(tmp_path):
    """GET /v1/files/{id}/content once sent the file by its path after the checks, so bytes
    removed meanwhile (a DELETE racing the download, a cleaned folder) were a 500 with a stack
    trace; the file is now opened before the answer starts."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvserve.batch.files import FileStore
    from kvserve.batch.routes import batch_router
    from kvserve.batch.service import BatchService

    conn = open_db(tmp_path)
    files, jobs = FileStore(conn, tmp_path, 2**20), JobStore(conn)
    app = FastAPI()
    app.include_router(batch_router(files, jobs, BatchService(files, jobs, None, window=1)))
    http = TestClient(app)

    def upload(n: int) -> dict:
        part = {"file": ("a.jsonl", b"{}\n" * n)}
        return http.post("/v1/files", data={"purpose": "batch"}, files=part).json()

    kept, gone = upload(3), upload(1)
    assert http.get(f"/v1/files/{kept['id']}/content").content == b"{}\n" * 3
    files.path(gone["id"]).unlink()
    resp = http.get(f"/v1/files/{gone['id']}/content")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "file_id", resp.text
