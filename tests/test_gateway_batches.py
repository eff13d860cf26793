"""The Batch API through `kvserve gateway` (kvserve/gateway/batches.py), as a LiteLLM proxy user
calls it with the openai client: files.create, batches.create, batches.retrieve, files.content.
A real `kvserve serve` backend and a real Redis; two gateway instances share it. Every one of
these calls was a 404 `unsupported_endpoint` before."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import openai
import pytest
from gateway_utils import GatewayProcess, RedisServer
from server_utils import ServerProcess, free_port

KEY, OTHER, BUDGET, NARROW = "sk-batch-a", "sk-batch-b", "sk-batch-budget", "sk-batch-narrow"
TPM, TINY, MASTER = "sk-batch-tpm", "sk-batch-tiny", "sk-batch-master"
IN_PRICE, OUT_PRICE, OUT_BATCH_PRICE = 0.001, 0.002, 0.0005  # the "priced" alias's
FINAL = ("completed", "failed", "cancelled", "expired")


def _line(i: int, model: str = "tiny") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"count to {i}"}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}  # fmt: skip
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-batches")
    redis_server = RedisServer()
    args = ("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--served-model-name", "tiny-backend")
    server = ServerProcess(tiny_llama_dir, *args, "--batch-storage-dir", str(tmp / "batch"))
    backend = {"base_url": server.url + "/v1", "model": "tiny-backend", "api_key": server.api_key}
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    prices = {"input_cost_per_token": IN_PRICE, "output_cost_per_token": OUT_PRICE,
              "output_cost_per_token_batches": OUT_BATCH_PRICE}  # fmt: skip
    cfg = {
        "model_list": [{"model_name": "tiny", "id": "tiny-a", "backend": backend},
                       {"model_name": "other", "id": "other-a", "backend": backend},
                       {"model_name": "spare", "id": "spare-dead", "backend": {**backend, "base_url": dead}},
                       {"model_name": "spare", "id": "spare-live", "backend": backend},
                       {"model_name": "priced", "id": "priced-a", "backend": {**backend, **prices}}],
        "router_settings": {"routing_strategy": "round-robin"},
        "keys": [{"key": KEY}, {"key": OTHER}, {"key": BUDGET, "max_budget": 10.0},
                 {"key": NARROW, "models": ["other"]}, {"key": TPM, "tpm": 100_000},
                 {"key": TINY, "max_budget": 0.001}],
        "general_settings": {"state": redis_server.url, "master_key": MASTER},
    }  # fmt: skip
    gws = []
    try:
        for name in ("gw1", "gw2"):  # each its own SQLite: what they share is the Redis
            c = {**cfg, "general_settings": {**cfg["general_settings"], "database": str(tmp / f"{name}.db")}}
            gws.append(GatewayProcess(c, str(tmp), name=name))
        yield gws
    finally:
        for g in gws:
            g.stop()
        server.stop()
        redis_server.stop()
    for g in gws:
        assert "Traceback" not in g.logs(), g.logs()


def _client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_a_batch_runs_through_the_gateway_and_is_only_its_keys(stack):
    gw1, gw2 = stack
    c = _client(gw1, KEY)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(i) for i in range(3)])), purpose="batch")
    assert f.purpose == "batch" and f.id.startswith("file-"), f
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.input_file_id == f.id and b.id.startswith("batch_"), b
    c2 = _client(gw2, KEY)  # another instance: the id names the deployment, no table needed
    deadline = time.monotonic() + 60
    while (b := c2.batches.retrieve(b.id)).status not in FINAL:
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    assert b.status == "completed" and b.request_counts.completed == 3, b
    assert b.model == "tiny", b  # the alias, not the backend's name for it
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    # the input file as uploaded: its lines' model the alias, not the backend's name (a file
    # downloaded and uploaded again was a 404 for model 'tiny-backend')
    lines = [json.loads(x) for x in c.files.content(f.id).text.splitlines()]
    assert lines == [_line(i) for i in range(3)], lines
    assert sorted(x["custom_id"] for x in out) == ["req-0", "req-1", "req-2"]
    assert all(x["response"]["status_code"] == 200 for x in out), out
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 3 for x in out), out
    # the key's lists, from either instance (the ids are kept in the shared Redis)
    assert [x.id for x in c2.batches.list().data] == [b.id]
    # the batch's output file too, as OpenAI's files.list shows it (purpose batch_output)
    listed = c2.files.list().data
    assert [x.id for x in listed] == [b.output_file_id, f.id], listed
    assert listed[0].purpose == "batch_output", listed
    f2 = c.files.create(file=("two.jsonl", _jsonl([_line(9)])), purpose="batch")
    page = c2.files.list(limit=1)  # newest first, paged as OpenAI's
    assert [x.id for x in page.data] == [f2.id] and page.has_more, page
    page = c2.files.list(limit=2, after=f2.id)
    assert [x.id for x in page.data] == [b.output_file_id, f.id] and not page.has_more, page
    assert c.files.delete(f2.id).deleted
    # another key: not its batch, not its file, nothing in its lists
    o = _client(gw1, OTHER)
    with pytest.raises(openai.NotFoundError):
        o.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        o.files.content(b.output_file_id)
    with pytest.raises(openai.NotFoundError):
        o.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert o.batches.list().data == [] and o.files.list().data == []
    # the master key reads any
    assert _client(gw1, "sk-batch-master").batches.retrieve(b.id).status == "completed"
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    assert [x.id for x in c.files.list().data] == [b.output_file_id]


def test_batch_requests_the_gateway_cannot_route_are_refused_naming_why(stack):
    gw = stack[0]
    c = _client(gw, KEY)
    two = _jsonl([_line(0), _line(1, "other")])
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("in.jsonl", two), purpose="batch")
    assert e.value.body["param"] == "file" and "line 2" in e.value.body["message"], e.value.body
    with pytest.raises(openai.NotFoundError) as e:  # a model the key may not use
        _client(gw, NARROW).files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
    assert e.value.body["code"] == "model_not_found" and "line 1" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):  # an id the gateway did not make
        c.batches.retrieve("batch_0123")
    # a key with a tpm limit: its upload is fine, but a batch's tokens have no per-minute window
    tpm = _client(gw, TPM)
    f = tpm.files.create(file=("in.jsonl", _jsonl([_line(0)])), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError) as e:
        tpm.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["code"] == "batch_not_allowed" and "tpm" in e.value.body["message"]
    r = httpx.post(gw.url + "/v1/batches", headers={"Authorization": "Bearer sk-nobody"})
    assert r.status_code == 401, r.text


def _finished(c: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + 60
    while (b := c.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    return b


def _spend(gw: GatewayProcess, key: str) -> float:
    r = httpx.get(gw.url + "/admin/spend?group_by=key", headers={"Authorization": f"Bearer {MASTER}"})
    h = hashlib.sha256(key.encode()).hexdigest()
    return sum(row["spend"] for row in r.json()["data"] if row["key"] == h)


def test_a_finished_batch_is_charged_to_its_key_once_and_lists_its_output_file(stack):
    """A key with a budget was refused batches (403 batch_not_allowed) and a batch's tokens were
    charged to no one. Now its usage is charged once, at the deployment's batch prices, to the
    key that made it, whichever instance sees it finish and however often it is read after."""
    gw1, gw2 = stack
    c, c2 = _client(gw1, BUDGET), _client(gw2, BUDGET)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(i, "priced") for i in range(2)])), purpose="batch")
    b = _finished(c2, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="24h").id)  # fmt: skip
    assert b.status == "completed" and b.usage.output_tokens == 6, b
    for client in (c, c2, _client(gw1, MASTER)):  # read again, listed: charged once all the same
        client.batches.retrieve(b.id)
        client.batches.list()
    want = b.usage.input_tokens * IN_PRICE + b.usage.output_tokens * OUT_BATCH_PRICE
    assert _spend(gw1, BUDGET) + _spend(gw2, BUDGET) == pytest.approx(want)
    # OpenAI's files.list shows a batch's output file beside the uploads
    assert b.output_file_id in [x.id for x in c.files.list().data], c.files.list()
    assert b.output_file_id in [x.id for x in c2.files.list().data]
    assert b.output_file_id not in [x.id for x in _client(gw1, KEY).files.list().data]


def test_files_list_takes_openais_purpose_and_order(stack):
    """files.list(purpose=..., order="asc") were ignored: every file of the key, newest first (with
    a batch's output files listed, purpose="batch" listed them too)."""
    c = _client(stack[0], NARROW)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(0, "other")])), purpose="batch")
    b = _finished(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)  # fmt: skip
    f2 = c.files.create(file=("in2.jsonl", _jsonl([_line(1, "other")])), purpose="batch")
    assert [x.id for x in c.files.list().data] == [f2.id, b.output_file_id, f.id]
    assert [x.id for x in c.files.list(purpose="batch").data] == [f2.id, f.id]
    assert [x.id for x in c.files.list(purpose="batch_output").data] == [b.output_file_id]
    assert [x.id for x in c.files.list(order="asc").data] == [f.id, b.output_file_id, f2.id]
    page = c.files.list(order="asc", after=f.id, limit=1)
    assert [x.id for x in page.data] == [b.output_file_id] and page.has_more, page
    r = httpx.get(stack[0].url + "/v1/files?order=up", headers={"Authorization": f"Bearer {NARROW}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "order", r.text


def test_a_key_whose_budget_a_batch_spent_gets_no_more_batches_nor_requests(stack):
    """The budget is checked when a batch is created (only a spent one refuses it); the batch's
    charge lands in the shared Redis budget, so the other instance refuses the key next."""
    gw1, gw2 = stack
    c = _client(gw1, TINY)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(0, "priced")])), purpose="batch")
    b = _finished(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)  # fmt: skip
    assert b.status == "completed", b  # (its cost is past the budget of 0.001: charged all the same)
    c2 = _client(gw2, TINY)
    with pytest.raises(openai.BadRequestError) as e:
        c2.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["code"] == "budget_exceeded", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c2.chat.completions.create(model="priced", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.body["code"] == "budget_exceeded", e.value.body


def test_an_upload_goes_on_to_the_groups_next_deployment_when_one_is_down(stack):
    """Of the alias's two deployments one is down: an upload that met it first was a 502, where
    a request would have gone on to the other. Round-robin sends one of these two there first."""
    c = _client(stack[0], KEY)
    for i in range(2):
        f = c.files.create(file=("in.jsonl", _jsonl([_line(i, "spare")])), purpose="batch")
        assert c.files.retrieve(f.id).id == f.id
        c.files.delete(f.id)


def test_a_responses_batchs_stored_responses_are_found_through_the_gateway(stack):
    """A /v1/responses batch stores each answer on the backend; its output lines carried the
    backend's own response ids, which the gateway's GET /v1/responses/{id} (and a follow-up's
    previous_response_id) answered 404: they name no deployment."""
    c = _client(stack[0], KEY)
    body = {"model": "tiny", "input": "count", "max_output_tokens": 3, "temperature": 0}
    line = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}
    f = c.files.create(file=("in.jsonl", _jsonl([line])), purpose="batch")
    b = _finished(
        c, c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h").id
    )
    assert b.status == "completed" and b.request_counts.completed == 1, b
    out = json.loads(c.files.content(b.output_file_id).text)
    stored = c.responses.retrieve(out["response"]["body"]["id"])
    assert (
        stored.id == out["response"]["body"]["id"]
        and stored.output_text == out["response"]["body"]["output"][0]["content"][0]["text"]
    )


def test_litellms_upload_fields_are_not_passed_to_the_backend(tmp_path):
    """LiteLLM's clients send their own form fields with an upload (custom_llm_provider,
    target_model_names); a strict backend (a hosted API) refused the upload for them. Only
    OpenAI's fields reach it. The same for batches.create's body (custom_llm_provider was
    passed on, and a hosted backend answered 400 "Unrecognized request argument")."""
    import asyncio

    from gateway_utils import FaultBackend

    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    fault = FaultBackend()
    cfg = {"model_list": [{"model_name": "m", "backend": {"base_url": fault.url + "/v1", "model": "ok"}}],
           "keys": [{"key": KEY}], "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    app = build_app(parse_config(cfg), web_ui=False)
    form = {"purpose": "batch", "custom_llm_provider": "openai", "target_model_names": "m",
            "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}  # fmt: skip

    async def upload() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post("/v1/files", data=form, files={"file": ("in.jsonl", _jsonl([_line(0, "m")]))},
                                headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip

    async def create(file_id: str) -> httpx.Response:  # (extra_body={"custom_llm_provider": ...})
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                "metadata": {"job": "1"}, "custom_llm_provider": "openai", "tags": ["a"]}  # fmt: skip
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post("/v1/batches", json=body, headers={"Authorization": f"Bearer {KEY}"})

    try:
        r = asyncio.run(upload())
        b = asyncio.run(create(r.json()["id"])) if r.status_code == 200 else None
    finally:
        fault.stop()
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "in.jsonl" and r.json()["id"].startswith("file-"), r.text
    # batches.create too: LiteLLM's body fields are the gateway's, OpenAI's own pass on
    assert b.status_code == 200 and b.json()["metadata"] == {"job": "1"}, b.text


def test_a_large_upload_is_parsed_off_the_event_loop(tmp_path):
    """The gateway read a file's lines (its alias, then each line's model rewritten) on the event
    loop: a 48 MiB upload held it for seconds, and every stream and request of that instance
    stalled meanwhile. A ticker on the loop sees how long it was held."""
    import asyncio

    from gateway_utils import FaultBackend

    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    fault = FaultBackend()
    gs = {"database": str(tmp_path / "gw.db"), "max_request_bytes": 64 * 2**20}
    cfg = {"model_list": [{"model_name": "m", "backend": {"base_url": fault.url + "/v1", "model": "ok"}}],
           "keys": [{"key": KEY}], "general_settings": gs}  # fmt: skip
    app = build_app(parse_config(cfg), web_ui=False)
    line = json.dumps(_line(0, "m")).encode() + b"\n"
    data = line * (48 * 2**20 // len(line))

    async def upload() -> tuple[httpx.Response, float]:
        longest, done = 0.0, False

        async def tick() -> None:
            nonlocal longest
            last = time.monotonic()
            while not done:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest, last = max(longest, now - last), now

        ticker = asyncio.create_task(tick())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=120)  # fmt: skip
        done = True
        await ticker
        return r, longest

    try:
        r, longest = asyncio.run(upload())
    finally:
        fault.stop()
    assert r.status_code == 200, r.text
    # Parsed on the loop it was held ~5 s on a quiet host; off it, the loop's own part (the
    # multipart read) held it up to 1.2 s at load average 11: a bound between the two.
    assert longest < 2.5, longest


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("multipart/form-data; boundary=xyz", b"garbage, no boundary in it"),
        (
            "multipart/form-data; boundary=xyz",
            b"--xyz\r\nContent-Disposition: form-data; name=purpose\r\n\r\n--xyz--\r\nmore",
        ),
        ("multipart/form-data; boundary=xyz", b"--xyz\r\nno headers end here"),
        ("multipart/form-data", b"--xyz\r\n\r\n"),
    ],
)
def test_a_garbled_upload_is_a_400_and_no_log_noise(tmp_path, caplog, content_type, body):
    """A malformed multipart body is the client's mistake: it gets a 400, and the gateway's log
    got python_multipart's WARNINGs for it (noise an operator cannot act on)."""
    import asyncio
    import logging

    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    cfg = {"model_list": [{"model_name": "m", "backend": {"base_url": f"http://127.0.0.1:{free_port()}/v1",
                                                          "model": "ok"}}],
           "keys": [{"key": KEY}], "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    app = build_app(parse_config(cfg), web_ui=False)

    async def upload() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            h = {"Authorization": f"Bearer {KEY}", "content-type": content_type}
            return await c.post("/v1/files", content=body, headers=h)

    with caplog.at_level(logging.INFO):
        r = asyncio.run(upload())
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text
    noise = [f"{x.name}: {x.getMessage()}" for x in caplog.records if x.levelno >= logging.WARNING]
    assert not noise, noise


def test_a_batch_of_a_key_regenerated_while_it_ran_is_charged_to_the_new_key(stack):
    """A batch created by a key that was then regenerated (/key/regenerate) was logged but not
    charged: its owner was remembered by the old key's hash, revoked by then. The spend belongs
    to the key, whatever its secret now: the new key's budget (here its user's) is charged and
    refuses it next."""
    gw1, gw2 = stack
    master = {"Authorization": f"Bearer {MASTER}"}
    body = {"user_id": "batch-user", "max_budget": 0.01, "models": ["priced"]}
    made = httpx.post(gw1.url + "/user/new", json=body, headers=master)
    assert made.status_code == 200, made.text
    old = made.json()["key"]
    c = _client(gw1, old)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(0, "priced")])), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    regen = httpx.post(gw2.url + "/key/regenerate", json={"key": old}, headers=master)
    assert regen.status_code == 200, regen.text
    new = _client(gw2, regen.json()["key"])
    b = _finished(new, b.id)  # (the new key sees the batch finish: the charge happens now)
    assert b.status == "completed" and b.usage.output_tokens == 3, b
    with pytest.raises(openai.BadRequestError) as e:  # its cost is past the budget: no more batches
        new.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["code"] == "budget_exceeded", e.value.body
    assert e.value.body["message"].startswith("Budget has been exceeded! User=batch-user"), e.value.body
    want = b.usage.input_tokens * IN_PRICE + b.usage.output_tokens * OUT_BATCH_PRICE
    info = httpx.get(gw2.url + "/key/info", params={"key": regen.json()["key"]}, headers=master).json()
    assert info["info"]["spend"] == pytest.approx(want), info


def test_a_finished_batch_is_charged_to_its_keys_model_max_budget(stack):
    """A batch's charge went to the key's, team's and user's budgets but not to the key's
    model_max_budget for the model it ran on, so the key went on spending on that model past it."""
    gw1, _ = stack
    master = {"Authorization": f"Bearer {MASTER}"}
    body = {"model_max_budget": {"priced": {"budget_limit": 0.05}}}
    key = httpx.post(gw1.url + "/key/generate", json=body, headers=master).json()["key"]
    c = _client(gw1, key)
    hi = [{"role": "user", "content": "hi"}]
    c.chat.completions.create(model="priced", messages=hi, max_tokens=1)  # (the store holds the budget now)
    f = c.files.create(file=("in.jsonl", _jsonl([_line(i, "priced") for i in range(4)])), purpose="batch")
    b = _finished(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)  # fmt: skip
    assert b.status == "completed", b
    assert b.usage.input_tokens * IN_PRICE + b.usage.output_tokens * OUT_BATCH_PRICE > 0.05, b.usage
    with pytest.raises(openai.BadRequestError) as e:  # (one request's most is under 0.05: the spend refuses)
        c.chat.completions.create(model="priced", messages=hi, max_tokens=1)
    assert "exceeded budget for model=priced" in e.value.body["message"], e.value.body
    assert c.chat.completions.create(model="tiny", messages=hi, max_tokens=1)
