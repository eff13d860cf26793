"""The official openai client through `kvserve gateway` to two real kvserve replicas behaves as
when it calls a replica directly: same greedy text, usage, tool calls and JSON mode. The replicas
run the tiny random model with a longer position range (a tool prompt is ~600 of its tokens)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import sqlite3
import time

import httpx
import openai
import pytest
from gateway_utils import GatewayProcess
from server_utils import ServerProcess

from kvserve.routing.responses_ids import decode_id

MODEL_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--served-model-name", "tiny")
KEY = "sk-gw"
RESP_KEY = "sk-responses"  # the Responses API test's own: its spend rows are only that test's
MSG = [{"role": "user", "content": "The quick brown fox"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_time", "description": "time in a city", "parameters": CITY},
    }
]


@pytest.fixture(scope="module")
def replicas(tiny_long_dir):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # start both at once
        rs = list(pool.map(lambda _: ServerProcess(tiny_long_dir, *MODEL_ARGS), range(2)))
    yield rs
    for r in rs:
        r.stop()


@pytest.fixture(scope="module")
def gw(replicas, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    cfg = {
        "model_list": [{"model_name": "tiny", "id": f"replica-{i}",
                        "backend": {"base_url": r.url + "/v1", "model": "tiny", "api_key": r.api_key,
                                    "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}}
                       for i, r in enumerate(replicas)],
        "keys": [{"key": KEY}, {"key": "sk-tpm", "tpm": 100000}, {"key": RESP_KEY, "tpm": 10**6}],
        "general_settings": {"database": str(tmp / "gw.db")},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp))
    yield g
    g.stop()
    assert "Traceback" not in g.logs(), g.logs()


@pytest.fixture(scope="module")
def via(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(replicas):
    return openai.OpenAI(base_url=replicas[0].url + "/v1", api_key=replicas[0].api_key, max_retries=0)


def test_chat_and_completions_identical(via, direct):
    kw = dict(model="tiny", messages=MSG, max_tokens=12, temperature=0)
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == b.choices[0].finish_reason and _tokens(a) == _tokens(b)
    kw = dict(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    a, b = via.completions.create(**kw), direct.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and _tokens(a) == _tokens(b)


def test_head_answers_as_get_without_a_body(gw):
    """Monitors probe the gateway with HEAD too (was 405)."""
    for path, headers in (
        ("/health", {}),
        ("/health/ready", {}),
        ("/v1/models", {"Authorization": f"Bearer {KEY}"}),
    ):
        head = httpx.head(gw.url + path, headers=headers)
        assert head.status_code == 200 and head.content == b"", path
    assert httpx.head(gw.url + "/v1/models").status_code == 401


def test_the_client_and_the_backend_see_one_request_id(gw):
    """The gateway dropped the client's X-Request-Id and returned none: the backend made its own,
    so a client's report could not be found in the backend's log (nor the gateway's line). Now
    the client's usable id, else the gateway's, goes to the backend and comes back, errors too."""
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    for sent in ({}, {"x-request-id": "trace-42"}, {"x-request-id": "bad id with spaces"}):
        r = httpx.post(gw.url + "/v1/completions", json=body, headers={**h, **sent}, timeout=60)
        rid = r.headers["x-request-id"]
        assert r.status_code == 200 and r.json()["id"] == f"cmpl-{rid}", (rid, r.text)
        assert rid == "trace-42" if sent.get("x-request-id") == "trace-42" else " " not in rid
    bad = {**body, "max_tokens": -1}  # the backend's 400, passed through
    r = httpx.post(gw.url + "/v1/completions", json=bad, headers={**h, "x-request-id": "t-400"}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"] == "t-400", r.text


def _tokens(r) -> tuple[int, int]:
    """Token counts (cached-token details differ with which replica's prefix cache was warm)."""
    return r.usage.prompt_tokens, r.usage.completion_tokens


def _streamed(client, usage: bool):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0,
                                                 stream=True, **extra))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_stream_with_and_without_usage(via, direct):
    text, chunks = _streamed(via, usage=True)
    want, want_chunks = _streamed(direct, usage=True)
    assert text == want and len(chunks) == len(want_chunks)
    assert _tokens(chunks[-1]) == _tokens(want_chunks[-1]) and chunks[-1].usage.completion_tokens == 12
    text, chunks = _streamed(via, usage=False)
    assert text == want
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert len(chunks) == len(_streamed(direct, usage=False)[1])


def test_an_include_usage_that_is_no_boolean_is_the_backends_400(gw):
    """stream_options.include_usage "yes" (or 1, null) is a 400 from kvserve serve and OpenAI, but
    the gateway overwrote it with true (it asks for usage to settle spend): the client's mistake
    streamed a 200 without the usage it asked for. It now reaches the backend as sent."""
    for bad in ("yes", 1, None):
        body = {"model": "tiny", "messages": MSG, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": bad}}  # fmt: skip
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "stream_options", r.text
        assert "include_usage" in r.json()["error"]["message"], r.text


def test_tools_and_response_format_identical(via, direct):
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0)
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    strip = lambda r: [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]  # noqa: E731
    assert strip(a) == strip(b)
    kw = dict(
        model="tiny", messages=MSG, response_format={"type": "json_object"}, max_tokens=30, temperature=0
    )
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_tpm_counts_with_the_replicas_tokenizer(gw, replicas):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    count = httpx.post(
        replicas[0].url + "/tokenize", json={"messages": MSG}, headers=replicas[0].headers
    ).json()
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-tpm"})
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100000 - count["count"]
    assert r.headers["x-kvserve-deployment"] in ("replica-0", "replica-1")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": 5}, "messages"),  # the key counts tokens: the gateway read messages as a list
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
        ({"messages": MSG, "stream": True, "stream_options": 5}, "stream_options"),
    ],
)
def test_a_malformed_body_gets_the_replicas_400_not_a_500(gw, body, param):
    """The gateway reads text from bodies to count, route and cache by; a body of the wrong
    shape once crashed it there (500, text/plain, a traceback in its log) before the replica
    could name the mistake."""
    h = {"Authorization": "Bearer sk-tpm"}
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "tiny", **body}, headers=h, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_a_refused_body_does_not_turn_token_counting_off(replicas, tmp_path):
    """The first /tokenize of a deployment finds out whether it is a kvserve replica; a 400
    there (the replica's verdict on that body) once switched the deployment to ~4-characters
    estimates for good, so every later tpm count was off."""
    r0 = replicas[0]
    cfg = {
        "model_list": [{"model_name": "tiny", "backend": {"base_url": r0.url + "/v1", "model": "tiny",
                                                          "api_key": r0.api_key}}],
        "keys": [{"key": "sk-tpm", "tpm": 100000}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path))
    try:
        h = {"Authorization": "Bearer sk-tpm"}
        bad = [{"role": "bogus", "content": "hi"}]
        r = httpx.post(g.url + "/v1/chat/completions", json={"model": "tiny", "messages": bad}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        msgs = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog " * 8}]
        count = httpx.post(r0.url + "/tokenize", json={"messages": msgs}, headers=r0.headers).json()["count"]
        body = {"model": "tiny", "messages": msgs, "max_tokens": 1}
        r = httpx.post(g.url + "/v1/chat/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100000 - count
    finally:
        g.stop()
    assert "Traceback" not in g.logs()


def test_embeddings_through_the_gateway(via, direct, gw, replicas):
    """POST /v1/embeddings was a 404 at the gateway; now routed like the other calls, with the
    key's tpm counted on the input (no completion tokens reserved)."""
    a = via.embeddings.create(model="tiny", input=["The quick brown fox", "jumps"])
    b = direct.embeddings.create(model="tiny", input=["The quick brown fox", "jumps"])
    assert [d.embedding for d in a.data] == [d.embedding for d in b.data] and len(a.data) == 2
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 0
    count = httpx.post(
        replicas[0].url + "/tokenize", json={"prompt": "The quick brown fox"}, headers=replicas[0].headers
    ).json()["count"]
    body = {"model": "tiny", "input": "The quick brown fox"}
    r = httpx.post(
        gw.url + "/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-tpm"}, timeout=60
    )
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == b.data[0].embedding
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 100000 - count


def _running(replicas) -> float:
    return sum(r.metrics()["kvserve:num_requests_running"] for r in replicas)


def test_client_disconnect_frees_the_replicas(gw, replicas):
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    h = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            req = lambda: http.build_request("POST", gw.url + "/v1/completions", json=body, headers=h)  # noqa: E731
            streams = [await http.send(req(), stream=True) for _ in range(6)]
            for resp in streams:
                it = resp.aiter_lines()
                for _ in range(3):
                    await it.__anext__()
            assert _running(replicas) > 0
            for resp in streams:
                await resp.aclose()

    asyncio.run(scenario())
    deadline = time.monotonic() + 30
    while _running(replicas) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(replicas) == 0, gw.logs()
    assert gw.logs().count("status=499") >= 6  # the gateway saw every client leave and let go upstream
    assert all(r.metrics()["kvserve:kv_cache_usage_perc"] == 0 for r in replicas)


def test_models_lists_aliases(via):
    assert [m.id for m in via.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        via.chat.completions.create(model="gpt-9", messages=MSG)
    assert json.loads(e.value.response.text)["error"]["code"] == "model_not_found"


def _spend_rows(gw, key: str, n: int) -> list[tuple]:
    """The key's spend rows once `n` are written (the log is flushed in batches)."""
    db = gw.config_path.replace("gw.yaml", "gw.db")
    h = hashlib.sha256(key.encode()).hexdigest()
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(db) as c:
            rows = c.execute(
                "SELECT deployment, prompt_tokens, completion_tokens, cost FROM spend WHERE key_hash = ?",
                (h,),
            ).fetchall()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_responses_api_through_the_gateway(gw, replicas):
    """POST /v1/responses was a 404 at the gateway. Now proxied like chat: usage (input/output
    tokens, streamed from the final event) is spent, and a follow-up with previous_response_id
    reaches the replica that stored the conversation (the other one would answer not found)."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=RESP_KEY, max_retries=0, timeout=60)
    raw = client.responses.with_raw_response.create(
        model="tiny", input="The quick brown fox", max_output_tokens=6, temperature=0
    )
    first, dep = raw.parse(), raw.headers["x-kvserve-deployment"]
    assert (
        first.output_text and first.usage.output_tokens > 0 and "x-ratelimit-remaining-tokens" in raw.headers
    )
    answers, prev = [first], first
    for _ in range(3):  # (a router spreading them would send one of three to the other replica)
        raw = client.responses.with_raw_response.create(
            model="tiny", input="and then?", previous_response_id=prev.id, max_output_tokens=4, temperature=0
        )
        nxt = raw.parse()
        assert raw.headers["x-kvserve-deployment"] == dep and nxt.previous_response_id == prev.id
        assert nxt.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens  # the history
        answers.append(nxt)
        prev = nxt
    events = list(
        client.responses.create(
            model="tiny", input="go on", previous_response_id=prev.id, max_output_tokens=4, stream=True
        )
    )
    last = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert events[0].response.id == last.id and last.previous_response_id == prev.id
    assert last.usage.input_tokens > prev.usage.input_tokens
    answers.append(last)
    got = client.responses.retrieve(last.id)
    items = client.responses.input_items.list(last.id)  # (a 404 before: no such route)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "go on")]
    assert got.id == last.id and got.output_text == last.output_text
    # input_tokens.count was a 405 (GET / DELETE /v1/responses/{id} matched its path); with a
    # previous_response_id it counts on the replica holding it, as that replica counts its own id
    # (and, running no model, is not charged: the spend rows below are the answers' alone)
    holder = replicas[int(dep.rsplit("-", 1)[1])]
    own = {"model": "tiny", "input": "c", "previous_response_id": decode_id(last.id)[1]}
    there = httpx.post(
        holder.url + "/v1/responses/input_tokens", json=own, headers=holder.headers, timeout=30
    )
    raw = client.responses.input_tokens.with_raw_response.count(
        model="tiny", input="c", previous_response_id=last.id
    )
    assert raw.headers["x-kvserve-deployment"] == dep
    assert raw.parse().input_tokens == there.json()["input_tokens"] > 0
    assert (
        client.responses.input_tokens.count(model="tiny", input="c").input_tokens
        < there.json()["input_tokens"]
    )
    url, h = gw.url + "/v1/responses/input_tokens", {"Authorization": f"Bearer {RESP_KEY}"}
    r = httpx.post(url, json={"input": "c"}, headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = httpx.post(
        url, json={"input": "c", "previous_response_id": "resp_0123456789abcdef"}, headers=h, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text
    rows = _spend_rows(gw, RESP_KEY, len(answers))
    assert sorted(r[1:3] for r in rows) == sorted(
        (a.usage.input_tokens, a.usage.output_tokens) for a in answers
    )
    assert {r[0] for r in rows} == {dep}
    for r in rows:
        assert r[3] == pytest.approx(r[1] * 1e-6 + r[2] * 2e-6)
    client.responses.delete(last.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(last.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_0123456789abcdef")
    assert json.loads(e.value.response.text)["error"]["code"] == "previous_response_not_found"


def test_a_responses_stream_is_committed_at_its_first_output_not_at_response_created():
    """The gateway commits a stream (no retry elsewhere, first-byte timeout over) at its
    answer's first event. A Responses stream opens with response.created and .in_progress
    before the model has produced anything: taken as the answer, a backend that hung or
    failed right after them could not be passed over, as chat's role chunk can."""
    from kvserve.gateway.sse import SSERelay
    from kvserve.routing.responses_ids import decode_id, public_event

    def event(obj: dict) -> bytes:
        return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n"

    resp = {"id": "resp_abc", "object": "response", "status": "in_progress", "usage": None}
    relay = SSERelay(True, lambda ev: ev)
    relay.feed(event({"type": "response.created", "response": resp}))
    relay.feed(event({"type": "response.in_progress", "response": resp}))
    assert not relay.answered
    relay.feed(event({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message"}}))
    assert relay.answered and relay.error_first is None
    failed = SSERelay(True)
    failed.feed(event({"type": "response.created", "response": resp}))
    failed.feed(event({"type": "error", "code": "server_error", "message": "engine died"}))
    assert failed.answered and failed.error_first == "engine died"
    done = {
        **resp,
        "status": "completed",
        "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
    }
    out = SSERelay(True, lambda ev: public_event(ev, "dep-1"))
    sent = out.feed(event({"type": "response.completed", "response": done}))
    assert out.usage == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    sent_id = json.loads(sent.split(b"data: ")[1])["response"]["id"]
    assert decode_id(sent_id) == ("dep-1", "resp_abc") and sent.startswith(b"event: response.completed\n")


def test_a_litellm_clients_extra_body_reaches_a_kvserve_replica_as_openai_fields(via, direct):
    """LiteLLM's body fields (as its users' clients send them) were forwarded, and the kvserve
    replica refused them (400, unknown field); the gateway takes them out now, so the answer
    is the replica's greedy answer to the plain request."""
    extra = {"metadata": {"tags": ["a"], "trace_id": 7}, "tags": ["t"], "num_retries": 1, "fallbacks": [],
             "caching": False, "user_api_key_alias": "x", "litellm_metadata": {"k": "v"}}  # fmt: skip
    kw = dict(model="tiny", messages=MSG, max_tokens=8, temperature=0)
    a = via.chat.completions.create(**kw, extra_body=extra)
    assert a.choices[0].message.content == direct.chat.completions.create(**kw).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="metadata"):  # (what the replica says to them)
        direct.chat.completions.create(**kw, extra_body={"metadata": extra["metadata"]})
