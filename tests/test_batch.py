"""Batch API end to end with the official `openai` client against real `kvserve serve`
processes (tiny random model: only ids, counts and shapes are checked), the background tier
of the scheduler against the Hugging Face reference, and `kvserve run-batch` offline."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy
from server_utils import ServerProcess

from kvserve import LLM, SamplingParams
from kvserve.request import BACKGROUND_PRIORITY

MODEL_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny")
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
FINAL = ("completed", "failed", "cancelled", "expired")


def line(i: int, max_tokens: int = 2, url: str = CHAT, **extra) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": max_tokens,
    }
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {**body, **extra}})


def upload(client: openai.OpenAI, lines: list[str]):
    return client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in FINAL:
            return b
        time.sleep(0.3)
    raise TimeoutError(f"batch {batch_id} did not finish")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("batch-store")
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "32", "--batch-storage-dir", str(store),
                      "--max-upload-size", str(2**20))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


# ---- the scheduler's background tier ---------------------------------------------------------


def test_background_requests_wait_behind_interactive_ones(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_seqs=2)  # fcfs, the default policy
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"bg-{i}", f"batch line {i}", params, priority=BACKGROUND_PRIORITY)
    engine.step()
    engine.step()  # two background requests run, four wait
    for i in range(2):
        engine.add_request(f"fg-{i}", f"interactive {i}", params)
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first.setdefault(out.request_id, step)
    assert max(first["fg-0"], first["fg-1"]) < min(first[f"bg-{i}"] for i in range(2, 6))
    assert max(first["fg-0"], first["fg-1"]) <= 2  # they took the running seats at once
    assert engine.scheduler.num_preemptions_total >= 2
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_background_tier_keeps_greedy_equal_to_the_reference(tiny_llama_dir):
    """Mixed tiers, few seats and a small pool (preemptions): every output is the reference's."""
    hf = load_reference(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, kv_cache_memory=24 * 16 * 512, max_num_seqs=3)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = {
        f"{'bg' if i < 4 else 'fg'}-{i}": engine.tokenizer.encode(f"prompt number {i} says") for i in range(8)
    }
    for rid, ids in prompts.items():
        if rid == "fg-4":
            engine.step()  # three background requests hold every seat
            engine.step()
        engine.add_request(rid, ids, params, priority=BACKGROUND_PRIORITY if rid.startswith("bg") else 0)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions_total > 0
    eos = [engine.tokenizer.eos_token_id]
    for rid, ids in prompts.items():
        assert_greedy_match(hf, ids, reference_greedy(hf, ids, 24, eos), list(outs[rid]), rid)


# ---- the HTTP API ----------------------------------------------------------------------------


def test_openai_client_round_trip(client):
    f = upload(client, [line(i) for i in range(20)])
    assert f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list()]
    b = client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"job": "t"}
    )
    assert b.status == "validating" and b.metadata == {"job": "t"}
    b = wait_final(client, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == 20 and b.request_counts.completed == 20 and b.request_counts.failed == 0
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.error_file_id is None
    out = read_lines(client, b.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(20))
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 2
    assert b.id in [x.id for x in client.batches.list()]
    assert_not_cancellable(client, b.id, "completed")
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_the_batch_names_the_model_its_lines_use(client):
    """OpenAI's Batch carries `model`, the model the lines ran on; it was null here. A line that
    names none runs on the default (its response says so); a model not served here is null."""
    named = [line(i) for i in range(2)]
    cmpl = [json.loads(line(i, url=CMPL)) for i in range(2)]
    unnamed = [json.dumps({**x, "body": {"prompt": "hi", "max_tokens": 1}}) for x in cmpl]
    unknown = [json.dumps({**x, "body": {"model": "gpt-x", "prompt": "hi"}}) for x in cmpl]
    models = {}
    for kind, lines in {"named": named, "unnamed": unnamed, "unknown": unknown}.items():
        url = CHAT if kind == "named" else CMPL
        file_id = upload(client, lines).id
        b = client.batches.create(input_file_id=file_id, endpoint=url, completion_window="24h")
        b = wait_final(client, b.id)
        assert b.status == "completed", b
        models[kind] = (b.model, client.batches.retrieve(b.id).model, b.request_counts.failed)
    assert models == {
        "named": ("tiny", "tiny", 0), "unnamed": ("tiny", "tiny", 0), "unknown": (None, None, 2)
    }  # fmt: skip


def test_a_batch_counts_the_tokens_of_its_lines_as_openais_usage(client):
    """OpenAI's Batch carries `usage` (input, cached, output, total tokens of the lines done);
    it was null here. It is the sum of the succeeded lines' usage; a failed line adds none."""
    lines = [line(i, max_tokens=3) for i in range(4)] + [line(9, temperature=-1)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    assert b.usage is not None and b.usage.total_tokens == 0
    b = wait_final(client, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (4, 1)
    usages = [o["response"]["body"]["usage"] for o in read_lines(client, b.output_file_id)]
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert b.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert b.usage.input_tokens_details.cached_tokens == sum(
        (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages
    )
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    assert b.usage.output_tokens_details.reasoning_tokens == 0
    listed = {x.id: x for x in client.batches.list(limit=100).data}  # (others of this module's server too)
    assert listed[b.id].usage == b.usage


def test_completions_endpoint_and_request_errors_become_error_lines(client):
    lines = [line(i, url="/v1/completions") for i in range(3)]
    lines = [
        json.dumps({**json.loads(x), "body": {"model": "tiny", "prompt": "hi", "max_tokens": 2}})
        for x in lines
    ]
    lines.append(json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": "hi", "temperature": -1}}))  # fmt: skip
    # a line fanning out past the per-request bound (OpenAI's 2,048 prompts) is refused as over HTTP
    fan_out = {"model": "tiny", "prompt": [[5]] * 2049, "max_tokens": 1}
    lines.append(json.dumps({"custom_id": "fan-out", "method": "POST", "url": CMPL, "body": fan_out}))
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/completions",
                              completion_window="24h")  # fmt: skip
    b = wait_final(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.request_counts.failed == 2
    errors = {e["custom_id"]: e["response"] for e in read_lines(client, b.error_file_id)}
    assert errors["bad-temp"]["status_code"] == 400
    assert errors["bad-temp"]["body"]["error"]["param"] == "temperature"
    assert errors["fan-out"]["status_code"] == 400
    assert errors["fan-out"]["body"]["error"]["param"] == "prompt"
    assert all(
        o["response"]["body"]["object"] == "text_completion" for o in read_lines(client, b.output_file_id)
    )


def test_embeddings_endpoint_answers_as_the_http_one(client, server):
    """OpenAI batches /v1/embeddings too: it was refused as an unsupported endpoint."""
    emb = "/v1/embeddings"
    bodies = {
        "one": {"model": "tiny", "input": "request 1"},
        "two": {"model": "tiny", "input": ["request 1", "request 2"], "encoding_format": "base64"},
        "empty": {"model": "tiny", "input": ""},
    }
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": emb, "body": b}) for k, b in bodies.items()]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=emb, completion_window="24h")
    b = wait_final(client, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    out = {o["custom_id"]: o["response"]["body"] for o in read_lines(client, b.output_file_id)}
    (err,) = read_lines(client, b.error_file_id)
    assert err["custom_id"] == "empty" and err["response"]["body"]["error"]["param"] == "input"
    http = client.embeddings.create(model="tiny", input=["request 1", "request 2"], encoding_format="float")
    assert out["one"]["object"] == "list" and out["two"]["usage"] == http.usage.model_dump()
    assert out["one"]["data"][0]["embedding"] == pytest.approx(http.data[0].embedding, abs=1e-6)
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in out["two"]["data"]]
    assert [d["index"] for d in out["two"]["data"]] == [0, 1]
    for got, want in zip(vectors, http.data):
        assert got.tolist() == pytest.approx(want.embedding, abs=1e-6)


def test_responses_endpoint_answers_as_the_http_one(client):
    """OpenAI batches /v1/responses: it was refused as an unsupported endpoint."""
    resp = "/v1/responses"
    bodies = {
        "text": {"model": "tiny", "input": "request 1", "max_output_tokens": 3, "temperature": 0},
        "items": {"model": "tiny", "input": [{"role": "user", "content": "r 2"}], "max_output_tokens": 2},
        "bad": {"model": "tiny", "input": "x", "max_output_tokens": 0},
    }
    lines = [json.dumps({"custom_id": k, "url": resp, "body": b}) for k, b in bodies.items()]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=resp, completion_window="24h")
    b = wait_final(client, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1), b
    out = {o["custom_id"]: o["response"]["body"] for o in read_lines(client, b.output_file_id)}
    (err,) = read_lines(client, b.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["body"]["error"]["param"] == "max_output_tokens"
    assert {r["object"] for r in out.values()} == {"response"}
    assert b.usage.input_tokens == sum(r["usage"]["input_tokens"] for r in out.values()) > 0
    assert b.usage.output_tokens == sum(r["usage"]["output_tokens"] for r in out.values()) > 0
    http = client.responses.create(**bodies["text"])
    assert out["text"]["output"][0]["content"][0]["text"] == http.output_text
    assert client.responses.retrieve(out["items"]["id"]).id == out["items"]["id"]  # stored, as over HTTP


def test_files_expire_as_their_expiration_policy_says(client, server):
    """expires_after on an upload and output_expires_after on a batch were accepted and ignored:
    expires_at stayed null and the files were kept."""
    policy = {"anchor": "created_at", "seconds": 3600}
    f = client.files.create(file=("in.jsonl", line(0).encode()), purpose="batch", expires_after=policy)
    assert f.expires_at == f.created_at + 3600 and client.files.retrieve(f.id).expires_at == f.expires_at
    assert {x.id: x.expires_at for x in client.files.list()}[f.id] == f.expires_at
    b = client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )  # fmt: skip
    out = client.files.retrieve(wait_final(client, b.id).output_file_id)
    assert out.expires_at == out.created_at + 7200
    kept = client.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    assert kept.expires_at is None
    for bad, param in (
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after[anchor]"),
        ({"anchor": "created_at", "seconds": 60}, "expires_after[seconds]"),
        ({"anchor": "created_at", "seconds": "9" * 5000}, "expires_after[seconds]"),
        ({"anchor": "created_at"}, "expires_after[seconds]"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("in.jsonl", b"{}\n"), purpose="batch", expires_after=bad)
        assert _error(e.value)["param"] == param and param in _error(e.value)["message"]
    r = httpx.post(f"{server.url}/v1/files", headers=server.headers, files={"file": ("a.jsonl", b"{}")},
                   data={"purpose": "batch", "expires_after": '{"seconds": 3600}'})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after"
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "now", "seconds": 3600}, {"seconds": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after=bad)  # fmt: skip
        assert _error(e.value)["param"] == "output_expires_after"


def test_an_expired_file_is_gone_as_if_deleted(tmp_path, monkeypatch):
    from kvserve.batch import files as files_mod
    from kvserve.batch.db import open_db

    conn = open_db(tmp_path)
    store = files_mod.FileStore(conn, tmp_path, 2**20)
    now = [1_000_000.0]
    monkeypatch.setattr(files_mod.time, "time", lambda: now[0])
    for fid, lives in (("file-short", 3600), ("file-long", 7200), ("file-kept", None)):
        store.path(fid).write_text("{}\n")
        store.register(fid, "in.jsonl", "batch", lives)
    now[0] += 3600
    assert {f["id"] for f in store.list()} == {"file-long", "file-kept"}
    assert not store.path("file-short").exists()
    now[0] += 3600
    with pytest.raises(files_mod.BatchAPIError) as e:
        store.get("file-long")
    assert e.value.status == 404 and not store.path("file-long").exists()
    assert store.get("file-kept")["expires_at"] is None
    conn.close()


def test_thousand_lines_with_five_malformed(client):
    bad = {
        100: "{not json",
        250: json.dumps({"method": "POST", "url": CHAT, "body": {}}),
        500: json.dumps({"custom_id": "x-500", "url": "/v1/embeddings", "body": {}}),  # not the batch's url
        750: "[1, 2, 3]",
        999: json.dumps({"custom_id": "x-999", "url": CHAT, "body": "text"}),
    }
    lines = [bad.get(i, line(i, max_tokens=1)) for i in range(1000)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    b = wait_final(client, b.id)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (1000, 995, 5)
    out, errors = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert len(out) == 995 and len(errors) == 5
    assert {o["custom_id"] for o in out} == {f"req-{i}" for i in range(1000) if i not in bad}
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    assert {e["custom_id"] for e in errors} == {None, "x-500", "x-999"}


def test_cancel_mid_way_keeps_finished_lines(client):
    lines = [line(i, max_tokens=48, ignore_eos=True) for i in range(300)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 300
    while client.batches.retrieve(b.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    queued = client.batches.create(input_file_id=upload(client, [line(0)]).id, endpoint=CHAT,
                                   completion_window="24h")  # fmt: skip
    q = client.batches.cancel(queued.id)  # waits behind b: cancelled at once, not after b
    assert q.status == "cancelled" and q.cancelled_at and q.request_counts.completed == 0
    assert_not_cancellable(client, queued.id, "cancelled")
    gone = upload(client, [line(0)])  # its input deleted while it waits behind b
    orphan = client.batches.create(input_file_id=gone.id, endpoint=CHAT, completion_window="24h")
    client.files.delete(gone.id)
    assert client.batches.retrieve(b.id).status == "in_progress"
    assert client.batches.cancel(b.id).status == "cancelling"
    b = wait_final(client, b.id)
    assert b.status == "cancelled" and b.cancelling_at and b.cancelled_at
    out = read_lines(client, b.output_file_id)
    assert 5 <= len(out) == b.request_counts.completed < 300
    assert len({o["custom_id"] for o in out}) == len(out)
    assert_not_cancellable(client, b.id, "cancelled")
    orphan = wait_final(client, orphan.id)
    (err,) = orphan.errors.data
    assert orphan.status == "failed" and err.code == "file_unreadable" and err.param == "input_file_id"
    assert err.message == f"input_file_id: {gone.id} cannot be read (it was deleted)"  # not the server's path
    assert_not_cancellable(client, orphan.id, "failed")


def finished_by_reason(server) -> dict[str, float]:
    """request_success_total by finished_reason."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=5).text
    rows = [x for x in text.splitlines() if x.startswith("kvserve:request_success_total{")]
    return {x.split('finished_reason="')[1].split('"')[0]: float(x.rsplit(" ", 1)[1]) for x in rows}


def test_cancel_stops_the_lines_in_flight_in_the_engine(client, server):
    """A cancelled batch's lines in flight were left generating to their end (the handler's
    reader task outlived the cancelled line); now they are aborted in the engine at once."""
    before = finished_by_reason(server)
    lines = [line(i, max_tokens=200, ignore_eos=True) for i in range(40)]
    b = client.batches.create(input_file_id=upload(client, lines).id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while server.metrics()["kvserve:num_batch_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.batches.cancel(b.id)
    b = wait_final(client, b.id)
    while server.metrics()["kvserve:num_batch_requests_running"] > 0:
        assert time.monotonic() < deadline + 120
        time.sleep(0.1)
    after = finished_by_reason(server)
    assert b.status == "cancelled"
    # the lines that ran to their end are the batch's completed ones; the rest were aborted
    assert after.get("length", 0) - before.get("length", 0) == b.request_counts.completed < 40
    assert after.get("abort", 0) - before.get("abort", 0) >= 1


def assert_not_cancellable(client: openai.OpenAI, batch_id: str, status: str) -> None:
    """A final batch cannot be cancelled: OpenAI's 409 naming its status (was a 200), unchanged."""
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(batch_id)
    err = e.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and f"status {status!r}" in err["message"], err
    assert client.batches.retrieve(batch_id).status == status


def test_custom_id_with_a_lone_surrogate_is_an_error_line_naming_it(client):
    """A custom_id holding a lone surrogate ("\\ud800": valid JSON, not UTF-8) is refused alone."""
    bad = json.dumps({"custom_id": "x-\ud800", "method": "POST", "url": CHAT, "body": {}})
    b = client.batches.create(input_file_id=upload(client, [line(0), bad, line(2)]).id, endpoint=CHAT,
                              completion_window="24h")  # fmt: skip
    b = wait_final(client, b.id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    (err,) = read_lines(client, b.error_file_id)
    assert err["error"]["code"] == "invalid_custom_id" and err["error"]["message"].startswith("custom_id:")
    assert sorted(o["custom_id"] for o in read_lines(client, b.output_file_id)) == ["req-0", "req-2"]


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_bad_input_names_the_field(client, server):
    f = upload(client, [line(0)])
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert _error(e.value)["param"] == "purpose"
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert _error(e.value)["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    assert _error(e.value)["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")
    assert _error(e.value)["param"] == "completion_window"
    files_dir = os.path.join(server.proc.args[server.proc.args.index("--batch-storage-dir") + 1], "files")
    kept = sorted(os.listdir(files_dir))
    for size in (2**20 + 1, 30 * 2**20):  # caught while copying; by its declared length
        with pytest.raises(openai.BadRequestError) as e:  # the server runs with --max-upload-size 1 MiB
            client.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        assert _error(e.value)["param"] == "file"
    assert sorted(os.listdir(files_dir)) == kept  # nothing of it stays on disk
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.retrieve("batch_nope")
    assert _error(e.value)["param"] == "batch_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.files.content("file-nope")
    assert _error(e.value)["param"] == "file_id"
    r = httpx.post(f"{server.url}/v1/files", headers=server.headers, data={"purpose": "batch"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(f"{server.url}/v1/batches", headers=server.headers, json={"endpoint": CHAT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"


# ---- durability ------------------------------------------------------------------------------


def test_kill_9_and_sigterm_mid_batch_then_resume(tiny_llama_dir, tmp_path):
    store = str(tmp_path / "store")
    args = (*MODEL_ARGS, "--max-num-seqs", "16", "--batch-storage-dir", store)
    s = ServerProcess(tiny_llama_dir, *args)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key, max_retries=0)
        # Long enough that the resumed server cannot finish the rest before the test has seen
        # 30 more lines complete (with 16 tokens a line, a fast host finished all of it first).
        lines = [line(i, max_tokens=64, ignore_eos=True) for i in range(300)]
        b = c.batches.create(input_file_id=upload(c, lines).id, endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 300
        while c.batches.retrieve(b.id).request_counts.completed < 30:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.batches.retrieve(b.id).status == "in_progress"
        core = s.engine_core_pid()
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
    finally:
        s.stop()
    _wait_gone(core)
    s = ServerProcess(tiny_llama_dir, *args)  # resumes; then SIGTERM mid-batch: a clean, prompt stop
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key, max_retries=0)
        at_kill = c.batches.retrieve(b.id).request_counts.completed
        deadline = time.monotonic() + 300
        while c.batches.retrieve(b.id).request_counts.completed < at_kill + 30:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.batches.retrieve(b.id).status == "in_progress"
        s.proc.terminate()
        assert s.proc.wait(25) == 0  # the drain does not wait for the batch (shutdown timeout 30 s)
    finally:
        s.stop()
    s = ServerProcess(tiny_llama_dir, *args)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key, max_retries=0)
        done = wait_final(c, b.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed) == (300, 300)
        ids = [o["custom_id"] for o in read_lines(c, done.output_file_id)]
        assert len(ids) == len(set(ids)) == 300  # none twice, none missing
        assert set(ids) == {f"req-{i}" for i in range(300)}
    finally:
        s.stop()


def test_resumed_batch_queued_behind_another_is_cancelled_at_once(tiny_llama_dir, tmp_path):
    """Two batches a stopped server left in progress: on restart the older one runs, the other
    waits behind it; cancelling that one finishes it at once (it stayed `cancelling` until the
    worker reached it), keeping the lines it had committed and none written after.

    A third, oldest one's input file was deleted while the server was down: it fails naming
    the file, keeping its committed line (was `internal_error` with the server's path), and
    the worker goes on to the others."""
    from kvserve.batch.db import open_db
    from kvserve.batch.files import FileStore, new_file_id
    from kvserve.batch.jobs import JobStore
    from kvserve.batch.output import DurableSink

    store = tmp_path / "store"
    conn = open_db(store)
    files, jobs = FileStore(conn, store, 2**20), JobStore(conn)
    ids = []
    for n, tokens in ((300, 48), (3, 2)):
        fid = new_file_id()
        files.path(fid).write_text(
            "\n".join(line(i, max_tokens=tokens, ignore_eos=True) for i in range(n)) + "\n"
        )
        files.register(fid, "in.jsonl", "batch")
        b = jobs.raw(jobs.create(fid, CHAT, "24h", None)["id"])
        jobs.set_total(b["id"], n)
        jobs.set_status(b, "in_progress")
        ids.append(b["id"])
    first, resumed = ids
    conn.execute("UPDATE batches SET created_at = created_at - 10 WHERE id = ?", (first,))  # runs first
    orphan = _in_progress_batch_with_one_line_done(files, jobs, conn)
    orphan_input = jobs.raw(orphan)["input_file_id"]
    files.delete(orphan_input)
    conn.execute("UPDATE batches SET created_at = created_at - 20 WHERE id = ?", (orphan,))  # before all
    obj = jobs.raw(resumed)
    out_path = files.path(obj["_output_path_id"])
    sink = DurableSink(conn, resumed, out_path, files.path(obj["_error_path_id"]), jobs.resume_point(resumed))
    body = {"status_code": 200, "request_id": "x", "body": {}}
    for i in range(2):
        sink.add(i, 0, {"id": f"r{i}", "custom_id": f"req-{i}", "response": body, "error": None}, True)
    sink.close()
    with open(out_path, "ab") as f:  # written after the last commit, then the server was killed
        f.write(b'{"custom_id": "req-2"')
    conn.close()
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "4", "--batch-storage-dir", str(store))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key, max_retries=0)
        gone = wait_final(c, orphan, timeout=60)
        assert gone.status == "failed" and gone.failed_at and len(gone.errors.data) == 1
        err = gone.errors.data[0]
        assert (err.code, err.param) == ("file_unreadable", "input_file_id")
        assert err.message == f"input_file_id: {orphan_input} cannot be read (it was deleted)"
        assert [o["custom_id"] for o in read_lines(c, gone.output_file_id)] == ["req-0"]
        q = c.batches.cancel(resumed)
        assert q.status == "cancelled" and q.cancelled_at and q.request_counts.completed == 2
        assert [o["custom_id"] for o in read_lines(c, q.output_file_id)] == ["req-0", "req-1"]
        assert c.batches.retrieve(first).status == "in_progress"  # still on the long one
        assert wait_final(c, c.batches.cancel(first).id).status == "cancelled"
    finally:
        s.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("content", ["", "dup"])
async def test_a_batch_cancelled_while_its_file_is_read_ends_cancelled(tmp_path, monkeypatch, content):
    """cancel() while the worker reads a validating batch's input, which then turns out empty
    or to repeat a custom_id: the batch ends `cancelled` (was marked `failed` over
    `cancelling` from the object read before the scan, its id left in the cancelled set)."""
    import asyncio
    import threading

    from kvserve.batch import service as service_mod
    from kvserve.batch.db import open_db
    from kvserve.batch.files import FileStore, new_file_id
    from kvserve.batch.jobs import JobStore

    store = tmp_path / "store"
    conn = open_db(store)
    files, jobs = FileStore(conn, store, 2**20), JobStore(conn)
    fid = new_file_id()
    files.path(fid).write_text("" if content == "" else line(0) + "\n" + line(0) + "\n")
    files.register(fid, "in.jsonl", "batch")
    batch_id = jobs.create(fid, CHAT, "24h", None)["id"]
    reading, cancelled = threading.Event(), threading.Event()
    real_scan = service_mod.scan_input

    def held_scan(path):  # the worker's thread: holds the scan until cancel() has run
        reading.set()
        assert cancelled.wait(10)
        return real_scan(path)

    monkeypatch.setattr(service_mod, "scan_input", held_scan)
    svc = service_mod.BatchService(files, jobs, serving=None, window=4)  # no line reaches serving
    svc.start()
    svc.submit(batch_id)
    try:
        assert await asyncio.to_thread(reading.wait, 10)
        assert svc.cancel(batch_id)["status"] == "cancelling"
        cancelled.set()
        for _ in range(200):
            if jobs.get(batch_id)["status"] not in ("validating", "cancelling"):
                break
            await asyncio.sleep(0.05)
        got = jobs.get(batch_id)
        assert got["status"] == "cancelled" and got["cancelled_at"] and got["failed_at"] is None, got
        assert batch_id not in svc._cancelled
    finally:
        await svc.stop()
        conn.close()


def _in_progress_batch_with_one_line_done(files, jobs, conn) -> str:
    from kvserve.batch.files import new_file_id
    from kvserve.batch.output import DurableSink

    fid = new_file_id()
    files.path(fid).write_text("\n".join(line(i) for i in range(3)) + "\n")
    files.register(fid, "in.jsonl", "batch")
    b = jobs.raw(jobs.create(fid, CHAT, "24h", None)["id"])
    jobs.set_total(b["id"], 3)
    jobs.set_status(b, "in_progress")
    paths = files.path(b["_output_path_id"]), files.path(b["_error_path_id"])
    sink = DurableSink(conn, b["id"], *paths, jobs.resume_point(b["id"]))
    body = {"status_code": 200, "request_id": "x", "body": {}}
    sink.add(0, 0, {"id": "r0", "custom_id": "req-0", "response": body, "error": None}, True)
    sink.close()
    return b["id"]


def _wait_gone(pid: int, timeout: float = 20) -> None:
    import psutil

    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.1)


# ---- offline ---------------------------------------------------------------------------------


BARE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_run_batch_offline(tiny_llama_dir, tmp_path):
    """Lines run, a broken one is an error line. vLLM's --max-logprobs, --chat-template,
    --swap-space, --trust-remote-code, --disable-log-requests were "unrecognized arguments":
    25 alternatives are taken under --max-logprobs 25, 26 a 400 line; the template renders."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    wide = [line(i, 1, logprobs=True, top_logprobs=k) for i, k in ((12, 25), (13, 26))]
    src.write_text("\n".join([line(i) for i in range(12)] + wide + ["not json"]) + "\n")
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(dst),
           "--model", tiny_llama_dir, "--served-model-name", "tiny", "--kv-cache-memory", "32MiB",
           "--max-model-len", "256", "--no-progress", "--max-logprobs", "25", "--chat-template", BARE,
           "--swap-space", "4", "--trust-remote-code", "--disable-log-requests"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "15 lines (13 ok, 2 errors)" in r.stderr
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    ok = sorted(k for k, o in out.items() if o["response"] and o["response"]["status_code"] == 200)
    assert ok == sorted(f"req-{i}" for i in range(13))
    from transformers import AutoTokenizer  # --chat-template: the prompt is the bare message

    bare = len(AutoTokenizer.from_pretrained(tiny_llama_dir).encode("request 0", add_special_tokens=False))
    assert out["req-0"]["response"]["body"]["usage"]["prompt_tokens"] == bare
    choice = out["req-12"]["response"]["body"]["choices"][0]
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 25
    refused = out["req-13"]["response"]
    assert refused["status_code"] == 400 and "(25; " in refused["body"]["error"]["message"], refused


@pytest.mark.parametrize(
    "args, message",
    [
        (["-i", "{tmp}/none.jsonl"], "argument -i/--input: '{tmp}/none.jsonl': no such file"),
        # after the model had loaded: "[Errno 2] No such file or directory", naming no flag
        (
            ["-o", "{tmp}/no-dir/out.jsonl"],
            "argument -o/--output: '{tmp}/no-dir/out.jsonl': no such directory",
        ),
        (["--window", "-1"], "argument --window: must be >= 1, got -1"),  # "Semaphore initial value ..."
    ],
)
def test_run_batch_arguments_are_checked_before_the_model_loads(args, message, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    (tmp_path / "in.jsonl").write_text(line(0) + "\n")
    base = {"-i": str(tmp_path / "in.jsonl"), "-o": str(tmp_path / "out.jsonl")}
    base.update(dict(zip(args[::2], args[1::2])))
    argv = [x.format(tmp=tmp_path) for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as e:
        main(["run-batch", *argv, "--model", str(tmp_path / "no-such-model")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: " + message.format(tmp=tmp_path) in err


def test_run_batch_refuses_a_vllm_option_it_cannot_honour_before_the_model_loads(tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    (tmp_path / "in.jsonl").write_text(line(0) + "\n")
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--load-format", "pt", "--model", str(tmp_path / "no-such-model")]) == 2
    assert capsys.readouterr().err.startswith("error: load-format: 'pt' is not supported")
