"""Batch API limits against one real `kvserve serve` (tiny random model): repeated custom_ids
fail a batch as OpenAI does, batch lines stay outside --max-waiting-requests, and the
validating pass holds a few bytes per line, not the file.

The server's waiting room (--max-waiting-requests 2) is smaller than its batch window (8),
so a batch keeps more lines waiting in the engine than the room allows: interactive requests
must still be admitted beside it, and batch lines must never be refused ("server busy")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import ServerProcess

from kvserve.batch.validate import scan_input

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "cancelled", "expired")
MAX_WAITING = 2
WINDOW = 8


def line(custom_id: str, max_tokens: int = 2) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"about {custom_id}"}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def upload(client: openai.OpenAI, lines: list[str]):
    return client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")


def wait_for(pred, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def final(client: openai.OpenAI, batch_id: str):
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in FINAL and b, f"batch {batch_id} final"
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-limits")
    s = ServerProcess(
        tiny_llama_dir, "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny",
        "--max-num-seqs", "4", "--max-waiting-requests", str(MAX_WAITING), "--batch-window", str(WINDOW),
        "--batch-storage-dir", str(tmp / "store"), log_path=str(tmp / "server.log"),
    )  # fmt: skip
    s.log_file = tmp / "server.log"
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def test_repeated_custom_id_fails_the_batch_naming_each_line(client):
    lines = [line(f"id-{i}") for i in range(50)]
    lines[20] = line("id-3")  # line 21 repeats line 4
    lines.append("")  # a blank line counts for nothing, but lines keep their numbers
    lines.append(line("id-3"))  # line 52
    lines.append("not json")  # an error line later, never a duplicate
    lines.append(json.dumps({"method": "POST", "url": CHAT, "body": {}}))  # no custom_id: same
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    b = final(client, b.id)
    assert b.status == "failed" and b.failed_at is not None and b.in_progress_at is None
    assert b.output_file_id is None and b.error_file_id is None
    errors = [e.model_dump() for e in b.errors.data]
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [
        ("duplicate_custom_id", 21, "custom_id"),
        ("duplicate_custom_id", 52, "custom_id"),
    ]
    assert "'id-3'" in errors[0]["message"] and "line 4" in errors[0]["message"]


def test_interactive_requests_are_admitted_while_a_batch_holds_the_queue(client, server):
    lines = [line(f"long-{i}", max_tokens=16) for i in range(2000)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    # The engine holds more waiting batch lines than the waiting room has seats.
    wait_for(lambda: server.metrics().get("kvserve:num_batch_requests_waiting", 0) > MAX_WAITING,
             "batch lines waiting in the engine", timeout=120)  # fmt: skip

    def ask(i: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=3
        )

    for round_ in range(3):
        with ThreadPoolExecutor(MAX_WAITING) as pool:  # a full waiting room of interactive requests
            answers = list(pool.map(ask, range(round_ * MAX_WAITING, (round_ + 1) * MAX_WAITING)))
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    running = client.batches.retrieve(b.id)
    assert running.status == "in_progress"
    assert running.request_counts.completed < running.request_counts.total - WINDOW  # it held the queue
    client.batches.cancel(b.id)
    assert final(client, b.id).status == "cancelled"


def test_batch_lines_are_never_refused_by_the_waiting_room(client, server):
    lines = [line(f"short-{i}") for i in range(40)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    b = final(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 40 and b.request_counts.failed == 0
    log = server.log_file.read_text()
    assert "server busy" not in log and "retrying" not in log  # no line was turned away and retried
    assert "Traceback" not in log


def test_run_batch_offline_refuses_repeated_custom_ids(tiny_llama_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("a"), line("b"), line("a")]) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(out),
           "--model", tiny_llama_dir, "--no-progress"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "custom_id 'a' on line 3 repeats line 1" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_validation_holds_a_few_bytes_per_line_not_the_file(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(100_000):  # only custom_id matters to this pass
            f.write(f'{{"custom_id": "row-{i}", "method": "POST", "url": "{CHAT}", "body": {{}}}}\n')
        f.write('{"custom_id": "row-99999"}\n')
    tracemalloc.start()
    try:
        scan = scan_input(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scan.total == 100_001 and [d[:2] for d in scan.duplicates] == [(100_001, 100_000)]
    # 8 bytes a line, sorted once: ~1.6 MB; a set of the ids would be ~10 MB, the lines ~20 MB
    assert peak < 4_000_000, peak


def test_list_routes_page_and_refuse_a_limit_out_of_range(client, server):
    fid = upload(client, [line("x"), line("x")]).id  # fails at validation: no engine work
    for _ in range(3):
        client.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")

    def get(path: str, **params) -> dict:
        r = httpx.get(f"{server.url}{path}", headers=server.headers, params=params, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    everything = [b["id"] for b in get("/v1/batches", limit=100)["data"]]
    assert len(everything) >= 3
    first = get("/v1/batches", limit=2)
    assert [b["id"] for b in first["data"]] == everything[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (everything[0], everything[1])
    rest = get("/v1/batches", limit=100, after=first["last_id"])
    assert [b["id"] for b in rest["data"]] == everything[2:] and rest["has_more"] is False
    for path, limit, code in [("/v1/batches", 0, "integer_below_min_value"),
                              ("/v1/batches", 101, "integer_above_max_value"),
                              ("/v1/files", -5, "integer_below_min_value"),
                              ("/v1/files", 10_001, "integer_above_max_value")]:  # fmt: skip
        r = httpx.get(f"{server.url}{path}", headers=server.headers, params={"limit": limit}, timeout=30)
        error = r.json()["error"]  # as OpenAI's: a 400 naming limit, not a page of another size
        assert r.status_code == 400 and (error["param"], error["code"]) == ("limit", code), r.text
        assert f"got {limit} instead" in error["message"]
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.batches.list(limit=500)
    more = [upload(client, [line("y")]).id for _ in range(2)]
    newest = [f["id"] for f in get("/v1/files", purpose="batch")["data"]]
    assert {fid, *more} <= set(newest) and get("/v1/files")["has_more"] is False
    page = get("/v1/files", limit=1, purpose="batch")
    assert [f["id"] for f in page["data"]] == newest[:1] and page["has_more"] is True  # once always False
    assert [f["id"] for f in get("/v1/files", limit=2, after=page["last_id"])["data"]] == newest[1:3]
    oldest = [f["id"] for f in get("/v1/files", order="asc", purpose="batch")["data"]]
    assert oldest == newest[::-1]
    assert [f.id for f in client.files.list(limit=1, purpose="batch")] == newest  # the SDK pages on
    r = httpx.get(f"{server.url}/v1/files", headers=server.headers, params={"after": "file-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"
