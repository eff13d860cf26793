"""Gateway failure semantics against the fault-injection backend (a real HTTP server): retries,
first-byte timeouts, mid-stream deaths, cooldowns, context-window fallbacks, pass-through 4xx,
client disconnects, and the memory store's limits and budgets on one instance."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time

import httpx
import openai
import pytest
import yaml
from gateway_utils import FaultBackend, GatewayProcess, deployment, leave_mid_body, wait_for_log
from lease_listener import ReleaseListener
from server_utils import free_port
from stream_endings import assert_chat_stream_failed, assert_responses_stream_failed, sse_events

KEY, MASTER = "sk-test", "sk-master"
MSG = [{"role": "user", "content": "one two three"}]


@pytest.fixture(scope="module")
def fault():
    fb = FaultBackend()
    yield fb
    fb.stop()


def _base(fault, tmp, **router) -> dict:
    u = fault.url + "/v1"
    return {
        "model_list": [
            deployment("retry500", u, "fail-500", weight=1000), deployment("retry500", u, "ok", weight=0.001),
            deployment("hang", u, "hang", first_byte_timeout=0.5), deployment("okgroup", u, "ok"),
            deployment("die", u, "die"), deployment("ctx", u, "ctx-400"), deployment("big", u, "ok"),
            deployment("small", u, "ok", max_context=5), deployment("bad", u, "bad-400"),
            deployment("r429", u, "fail-429"), deployment("slow", u, "slow"),
            deployment("slow8", u, "slow", max_connections=8, first_byte_timeout=60),
            deployment("r429nan", u, "429-nan"),
            deployment("hold", u, "hold-1"), deployment("crlf", u, "crlf"),
            deployment("pd400", u, "bad-400", prefill_url=u, max_parallel_requests=1),
            {"model_name": "pdmix", "id": "pdmix-pd",
             "backend": {"base_url": u, "model": "fail-500", "prefill_url": u, "weight": 1000}},
            {"model_name": "pdmix", "id": "pdmix-plain",
             "backend": {"base_url": u, "model": "ok", "weight": 0.001}},
            {"model_name": "authmix", "id": "authmix-bad",
             "backend": {"base_url": u, "model": "auth-401", "weight": 1000}},
            {"model_name": "authmix", "id": "authmix-ok",
             "backend": {"base_url": u, "model": "ok", "weight": 0.001}},
            deployment("authbad", u, "auth-401"),
            {"model_name": "nfmix", "id": "nfmix-bad",
             "backend": {"base_url": fault.url + "/nope/v1", "model": "ok", "weight": 1000}},
            {"model_name": "nfmix", "id": "nfmix-ok",
             "backend": {"base_url": u, "model": "ok", "weight": 0.001}},
            deployment("nfbad", fault.url + "/nope/v1", "ok"),
            deployment("pd404", u, "ok", prefill_url=fault.url + "/nope/v1"),
            deployment("pdauth", u, "ok", prefill_url=fault.url + "/deny/v1"),
            deployment("denied", fault.url + "/deny/v1", "ok"),
            {"model_name": "deprpm", "id": "deprpm-a", "backend": {"base_url": u, "model": "ok", "rpm": 1}},
            {"model_name": "deprpm", "id": "deprpm-b", "backend": {"base_url": u, "model": "ok", "rpm": 1}},
            {"model_name": "priced", "backend": {"base_url": u, "model": "ok", "input_cost_per_token": 0.5,
                                                 "output_cost_per_token": 0.25}},
            deployment("narrow", u, "ok", max_context=5),  # no context_window_fallbacks
            deployment("pinghang", u, "ping-hang", first_byte_timeout=0.5),
            deployment("stoplong", u, "stop-400"),
            deployment("latebody", u, "late-body", first_byte_timeout=0.5),
            deployment("holdlong", u, "hold-1", first_byte_timeout=0.5),
            {"model_name": "pricedie", "backend": {"base_url": u, "model": "die", "input_cost_per_token": 0.5,
                                                   "output_cost_per_token": 0.25}},
            {"model_name": "pricedhold", "backend": {"base_url": u, "model": "hold-20",
                                                     "input_cost_per_token": 0.5,
                                                     "output_cost_per_token": 0.25}},
            {"model_name": "nototal", "backend": {"base_url": u, "model": "no-total",
                                                  "input_cost_per_token": 0.5,
                                                  "output_cost_per_token": 0.25}},
            {"model_name": "ctxmix", "id": "ctxmix-short",
             "backend": {"base_url": u, "model": "ok", "max_context": 10, "weight": 1000,
                         "input_cost_per_token": 0.5, "output_cost_per_token": 0.25}},
            {"model_name": "ctxmix", "id": "ctxmix-long",
             "backend": {"base_url": u, "model": "ok", "max_context": 100, "weight": 0.001,
                         "input_cost_per_token": 0.5, "output_cost_per_token": 0.25}},
            deployment("down", u, "fail-500"), deployment("unterminated", u, "unterminated"),
            {"model_name": "errmid", "id": "errmid-only", "backend": {"base_url": u, "model": "error-mid"}},
            deployment("rolehang", u, "role-hang", first_byte_timeout=0.5, idle_timeout=1),
            {"model_name": "roleerr", "id": "roleerr-bad", "backend": {"base_url": u, "model": "role-error",
                                                                       "weight": 1000}},
            {"model_name": "roleerr", "id": "roleerr-ok", "backend": {"base_url": u, "model": "ok",
                                                                      "weight": 0.001}},
            {"model_name": "rolerefused", "id": "rolerefused-bad",
             "backend": {"base_url": u, "model": "role-refused", "weight": 1000}},
            {"model_name": "rolerefused", "id": "rolerefused-ok",
             "backend": {"base_url": u, "model": "ok", "weight": 0.001}},
            {"model_name": "htmlmix", "id": "htmlmix-page", "backend": {"base_url": u, "model": "html-200",
                                                                        "weight": 1000}},
            {"model_name": "htmlmix", "id": "htmlmix-ok", "backend": {"base_url": u, "model": "ok",
                                                                      "weight": 0.001}},
            deployment("echo", u, "echo-keys"), deployment("down2", u, "fail-500"),
            {"model_name": "r429pair", "id": "r429pair-a", "backend": {"base_url": u, "model": "fail-429",
                                                                       "weight": 1000}},
            {"model_name": "r429pair", "id": "r429pair-b", "backend": {"base_url": u, "model": "fail-429",
                                                                       "weight": 0.001}},
            {"model_name": "pricedhdr", "backend": {"base_url": u, "model": "ok", "input_cost_per_token": 0.5,
                                                    "output_cost_per_token": 0.25}},
        ],
        "router_settings": {"num_retries": 1, "retry_backoff_base": 0.01, "allowed_fails": 100,
                            "fallbacks": {"hang": ["okgroup"], "pinghang": ["okgroup"], "die": ["okgroup"],
                                          "bad": ["okgroup"], "down": ["okgroup"], "rolehang": ["okgroup"]},
                            "context_window_fallbacks": {"ctx": ["big"], "small": ["big"],
                                                         "stoplong": ["big"]},
                            "model_group_alias": {"gpt-4o": "big",
                                                  "secret-big": {"model": "big", "hidden": True}},
                            **router},
        "keys": [
            {"key": KEY, "alias": "tester"},
            {"key": "sk-limited", "models": ["okgroup"]},
            {"key": "sk-alias-only", "models": ["gpt-4o"]},
            {"key": "sk-no-fallbacks", "models": ["down", "small", "ctx"]},
            {"key": "sk-rpm2", "rpm": 2}, {"key": "sk-tpm5", "tpm": 5},
            {"key": "sk-par1", "max_parallel_requests": 1},
            {"key": "sk-budget", "max_budget": 5.0},
            {"key": "sk-budget-die", "max_budget": 100.0},  # priced: 3 words * 0.5 + 2 tokens * 0.25 = 2.0
            {"key": "sk-budget-hold", "max_budget": 20.0},
            {"key": "sk-par1-nototal", "max_parallel_requests": 1, "max_budget": 100.0},
            {"key": "sk-team-a", "team": "t"}, {"key": "sk-team-b", "team": "t"},
        ],
        "teams": {"t": {"rpm": 1}},
        "response_cache": {"models": ["echo"]},
        "general_settings": {"master_key": MASTER, "database": str(tmp / "gw.db"),
                             "max_request_bytes": 65536},
    }  # fmt: skip


@pytest.fixture(scope="module")
def producer():
    """A kv_producer's port: the leases the gateway releases (tests/lease_listener.py)."""
    listener = ReleaseListener()
    yield listener
    listener.close()


def _leased(fault, port: int) -> list[dict]:
    """pd deployments whose prefill makes a lease on `port`: one whose decode fails, beside one
    answering (sharing its prefill_url), and one alone."""
    u, m = fault.url + "/v1", f"leased-{port}-"
    return [
        {"model_name": "pdlease", "id": "pdlease-down",
         "backend": {"base_url": u, "model": m + "fail-500", "prefill_url": u, "weight": 1000}},
        {"model_name": "pdlease", "id": "pdlease-ok",
         "backend": {"base_url": u, "model": m + "ok", "prefill_url": u, "weight": 0.001}},
        deployment("pdleasedown", u, m + "fail-500", prefill_url=u),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gw(fault, producer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-faults")
    cfg = _base(fault, tmp)
    cfg["model_list"] += _leased(fault, producer.port)
    g = GatewayProcess(cfg, str(tmp))
    yield g
    g.stop()
    assert "Traceback" not in g.logs(), g.logs()


def post(gw, model, key=KEY, **body):
    body = {"model": model, "messages": MSG, "max_tokens": 2, **body}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)  # fmt: skip


def client(gw, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_500_is_retried_on_the_other_deployment(gw, fault):
    before = fault.count("fail-500")
    for _ in range(3):
        r = post(gw, "retry500")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvserve-deployment"] == "retry500-1"
    assert fault.count("fail-500") > before  # the 500 really happened (weights make it the first pick)
    assert r.headers["x-kvserve-attempts"] in ("1", "2")


def test_no_stream_waits_for_a_connection_while_the_deployment_has_one_free(gw, fault):
    """max_connections 8 is two clients of 4. Taken in turn, long and short streams alternating
    put every long one on the same client: the 5th waited there for one of the first 4 to end
    (60 s; first_byte_timeout 60: not retried elsewhere) while the other client's connections
    sat idle, and this client's 15 s read timeout ran out."""
    opened, lines = [], []
    try:
        for i in range(5):
            long = {"model": "slow8", "messages": MSG, "max_tokens": 600, "stream": True}
            cm = httpx.stream("POST", gw.url + "/v1/chat/completions", json=long,
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=15)  # fmt: skip
            r = cm.__enter__()
            opened.append(cm)
            assert r.status_code == 200
            lines.append(r.iter_lines())  # (kept: a generator collected closes its stream)
            assert next(line for line in lines[-1] if line.startswith("data: "))
            if i < 4:
                assert post(gw, "slow8", max_tokens=1, stream=True).status_code == 200
    finally:
        for cm in opened:
            cm.__exit__(None, None, None)


def test_hang_hits_first_byte_timeout_and_falls_back(gw, fault):
    before = fault.count("hang")
    t0 = time.monotonic()
    body = {"model": "hang", "messages": MSG, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        assert r.headers["x-kvserve-deployment"] == "okgroup-3"
        assert r.headers["x-kvserve-attempts"] == "3"  # two hung attempts (1 retry) then the fallback
        assert any(line == "data: [DONE]" for line in r.iter_lines())
    assert fault.count("hang") == before + 2
    assert time.monotonic() - t0 < 30  # did not wait for the 60 s hang


def test_a_non_streamed_answer_is_not_cut_by_first_byte_timeout(gw, fault):
    """kvserve and vLLM send a non-streamed answer's status line with the finished answer, so
    first_byte_timeout (0.5 s here) cut every generation longer than it, retried it and lost
    its work twice; only the total timeout bounds a non-streamed attempt now."""
    before = fault.count("hold-1")
    r = post(gw, "holdlong")  # answers after 1 s
    assert r.status_code == 200 and r.headers["x-kvserve-attempts"] == "1", (r.status_code, r.headers)
    assert fault.count("hold-1") == before + 1


def test_an_sse_comment_is_not_the_first_byte(gw, fault):
    """A backend that sends only an SSE comment (": ping", a keep-alive) and then nothing had
    'answered': the gateway committed the stream to it (no first-byte timeout, no retry, no
    fallback) and the client waited out the total timeout. Only a data event counts now."""
    before = fault.count("ping-hang")
    body = {"model": "pinghang", "messages": MSG, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "okgroup-3", r.headers
        assert r.headers["x-kvserve-attempts"] == "3"  # two silent attempts (1 retry), then the fallback
        text = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                       for x in r.iter_lines() if x.startswith("data: {"))  # fmt: skip
    assert text == " tok tok" and fault.count("ping-hang") == before + 2


def _streamed_text(r: httpx.Response) -> str:
    return "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                   for x in r.iter_lines() if x.startswith("data: {"))  # fmt: skip


def test_chats_opening_chunk_is_not_the_first_byte(gw, fault):
    """kvserve serve and vLLM open a chat stream with the role (no content) before the model
    has produced anything: the gateway committed the stream to a deployment on that chunk, so
    a hung one was never cut by first_byte_timeout nor retried or fallen back from, and one
    whose engine died before the first token sent the client an error. Both move on now."""
    before = fault.count("role-hang"), fault.count("role-error")
    for model, served_by, attempts in (("rolehang", "okgroup-3", "3"), ("roleerr", "roleerr-ok", "2")):
        body = {"model": model, "messages": MSG, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
            assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == served_by, r.headers
            assert r.headers["x-kvserve-attempts"] == attempts
            assert _streamed_text(r) == " tok tok"
    assert (fault.count("role-hang"), fault.count("role-error")) == (before[0] + 2, before[1] + 1)


def test_a_stream_refused_at_its_first_event_is_passed_on_not_retried(gw, fault):
    """A stream whose first event is the request's own 400 (kvserve serve's invalid_value, e.g.
    allowed_token_ids its grammar refuses at output token 0) was a failed attempt: retried on the
    group's other deployment, which answered it. Every kvserve would refuse it: the stream is
    passed on as a backend's 4xx is, once."""
    before = fault.count("role-refused")
    body = {"model": "rolerefused", "messages": MSG, "max_tokens": 2, "stream": True}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "rolerefused-bad", r.headers
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "invalid_value" and events[-1] == "[DONE]", r.text
    assert fault.count("role-refused") == before + 1


def test_a_body_after_the_first_byte_has_the_total_timeout_not_the_first_byte_one(gw, fault):
    """A deployment that answered at once (status, first bytes) and sent the rest of a
    non-streamed body later was cut off by first_byte_timeout (0.5 s here), which still ran
    over the body's read, and retried: the total timeout is what bounds the body."""
    before = fault.count("late-body")
    r = post(gw, "latebody")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " tok", r.text
    assert r.headers["x-kvserve-attempts"] == "1" and fault.count("late-body") == before + 1


def test_death_mid_stream_gives_an_sse_error_and_no_retry(gw, fault):
    before_die, before_ok = fault.count("die"), fault.count("ok")
    text = ""
    with pytest.raises(openai.APIError) as e:
        for chunk in client(gw).chat.completions.create(model="die", messages=MSG, max_tokens=8, stream=True):
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert "mid-stream" in str(e.value)
    assert e.value.body["code"] == "upstream_error"  # a string code, as outside a stream
    assert text == " tok tok"  # what arrived before the death, then the error — not a silent end
    assert fault.count("die") == before_die + 1 and fault.count("ok") == before_ok


def test_a_stream_broken_off_ends_as_kvserve_serve_ends_a_failed_one(gw):
    """A deployment dying mid-stream got the client an error event and no `data: [DONE]`
    (kvserve serve sends its error event, then [DONE]: clients that read to [DONE] waited); and
    a Responses stream got chat's error shape. Now: chat's error event, then [DONE]; a Responses
    stream its own numbered error event (after response.created and two deltas: 3), no [DONE]."""
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "die", "messages": MSG, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        assert_chat_stream_failed(sse_events(r.read()), "mid-stream")
    body = {"model": "die", "input": "one two", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        assert_responses_stream_failed(sse_events(r.read()), 3, "mid-stream")


def _spend_rows(gw, model: str, requests: int = 1, tries: int = 100) -> list[dict]:
    """The spend log's rows for `model`, polled until they count `requests` (the log is written
    in the background) or `tries` polls 0.1 s apart have passed."""
    m = {"Authorization": f"Bearer {MASTER}"}
    rows: list[dict] = []
    for _ in range(tries):
        rows = httpx.get(gw.url + "/admin/spend", params={"group_by": "model"}, headers=m).json()["data"]
        rows = [r for r in rows if r["model"] == model]
        if rows and rows[0]["requests"] >= requests:
            break
        time.sleep(0.1)
    return rows


def test_an_error_event_mid_stream_is_a_failed_stream_not_a_200(gw):
    """kvserve serve ends a stream whose engine died mid-answer with an error event (and [DONE]),
    not a cut connection: the gateway passed it on but logged, counted and billed the request as
    a 200, and the deployment as having answered. The client still gets the event; the request
    is now a 502 failed mid-stream (engine_dead, the deployment's fault, counts towards its
    cooldown), charged what it delivered."""
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=30,
                      default_headers={"x-request-id": "errmid-46"})  # fmt: skip
    got = []
    with pytest.raises(openai.APIError, match="engine died"):
        for chunk in c.chat.completions.create(model="errmid", messages=MSG, max_tokens=4, stream=True):
            got.append(chunk.choices[0].delta.content if chunk.choices else None)
    assert got == [" tok", " tok"], got
    logs = wait_for_log(gw.logs, "request_id=errmid-46", timeout=10)
    line = next(x for x in logs.splitlines() if "request_id=errmid-46" in x)
    assert "deployment=errmid-only status=502" in line, line
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'deployment="errmid-only",outcome="failed_mid_stream"' in metrics
    assert 'deployment="errmid-only",outcome="ok"' not in metrics


def test_a_stream_cut_mid_way_is_charged_what_it_delivered(gw):
    """A deployment dying mid-stream sends no usage; the key was charged its whole reservation
    (3 x 0.5 + 40 x 0.25 = 11.5) for the two tokens it got. Now the tokens delivered are
    counted: 3 x 0.5 + 2 x 0.25 = 2.0, and the spend log has the counts."""
    with pytest.raises(openai.APIError):
        for _ in client(gw, "sk-budget-die").chat.completions.create(
            model="pricedie", messages=MSG, max_tokens=40, stream=True
        ):
            pass
    rows = _spend_rows(gw, "pricedie")
    assert rows == [{"model": "pricedie", "requests": 1, "prompt_tokens": 3, "completion_tokens": 2,
                     "spend": 2.0}], rows  # fmt: skip


def test_hanging_up_on_a_non_streamed_request_is_charged_its_reservation(gw, fault):
    """A client that left while a non-streamed request was on its deployment was charged 0
    (and logged no spend): work for free by hanging up. The backend is stopped (its KV freed),
    and as how far it got cannot be known, the reservation on that deployment is charged:
    3 x 0.5 + 40 x 0.25 = 11.5 of a budget of 20, so a second such request no longer fits."""
    before, sent = fault.stats()["cancelled_holds"], fault.count("hold-20")
    body = json.dumps({"model": "pricedhold", "messages": MSG, "max_tokens": 40}).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-budget-hold\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while fault.count("hold-20") == sent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fault.count("hold-20") == sent + 1  # the backend has it; now the client hangs up
    rows = _spend_rows(gw, "pricedhold", tries=150)  # settled once the gateway sees the client gone
    assert rows == [{"model": "pricedhold", "requests": 1, "prompt_tokens": 3, "completion_tokens": 40,
                     "spend": 11.5}], rows  # fmt: skip
    deadline = time.monotonic() + 15
    while fault.stats()["cancelled_holds"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fault.stats()["cancelled_holds"] == before + 1  # the backend's work was still stopped
    r = post(gw, "pricedhold", key="sk-budget-hold", max_tokens=40)  # (the budget never resets: a 400)
    assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded", r.text


def test_usage_without_total_tokens_is_settled_and_frees_the_keys_slot(gw):
    """A backend whose usage has no total_tokens (prompt and completion only) made the end of
    a stream fail silently: nothing was settled or logged, the key's parallel slot and its
    reservation stayed held until the TTL (the second stream of a max_parallel_requests 1 key
    was refused), and the gateway counted the stream in flight forever. Now the total is the
    sum, each stream is charged (3 x 0.5 + 2 x 0.25 = 2.0) and frees its slot."""
    c = client(gw, "sk-par1-nototal")
    for stream in (True, True, False):
        if stream:
            chunks = c.chat.completions.create(model="nototal", messages=MSG, max_tokens=2, stream=True)
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " tok tok"
        else:
            answer = c.chat.completions.create(model="nototal", messages=MSG, max_tokens=2)
            assert answer.choices[0].message.content == " tok tok"
    rows = _spend_rows(gw, "nototal", requests=3)
    assert rows == [{"model": "nototal", "requests": 3, "prompt_tokens": 9, "completion_tokens": 6,
                     "spend": 6.0}], rows  # fmt: skip


def test_backend_context_400_goes_to_context_window_fallback(gw):
    r = post(gw, "ctx")
    assert r.status_code == 200, r.text
    assert r.headers["x-kvserve-deployment"] == "big-6"


def test_a_400_about_something_else_being_too_long_is_not_a_context_error(gw, fault):
    """Any 400 with "too long" in it counted as the prompt exceeding the context: a backend's
    "stop: ... too long" went to the context_window_fallbacks (another model answered a request
    the client must fix). Only the context-length error does now; this one is passed through."""
    before, big = fault.count("stop-400"), fault.count("ok")
    r = post(gw, "stoplong")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert fault.count("stop-400") == before + 1 and fault.count("ok") == big


@pytest.mark.parametrize(
    "message, code",
    [
        ("This model's maximum context length is 8 tokens; your prompt is longer", None),  # OpenAI, vLLM
        ("whatever the words", "context_length_exceeded"),
        ("'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context "
         "length is 64 tokens and your request has 60 input tokens", None),  # newer vLLM
        ("The decoder prompt (length 600) is longer than the maximum model length of 512.", None),  # vLLM
        ("The input (600 tokens) is longer than the model's context length (512 tokens).", None),  # SGLang
        ("the request exceeds the available context size, try increasing it", None),  # llama.cpp
        ("prompt: this model's maximum context length is 512 tokens and the prompt has 600", None),  # kvserve
    ],
)  # fmt: skip
def test_context_errors_are_told_by_code_or_their_known_phrasings(message, code):
    from kvserve.gateway.retries import is_context_error

    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    assert is_context_error(400, body.encode())
    for other in ("stop: sequence too long", "user: name too long", "logit_bias: too long a list"):
        assert not is_context_error(400, json.dumps({"error": {"message": other}}).encode())
    assert not is_context_error(500, body.encode())


def test_prompt_over_max_context_goes_to_context_window_fallback(gw):
    r = post(gw, "small", messages=[{"role": "user", "content": "a b c d e f g h i j"}])
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "big-6"
    r = post(gw, "small", messages=[{"role": "user", "content": "a"}])
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "small-7"


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_a_prompt_too_long_everywhere_names_its_field(gw, path, field):
    text = "a b c d e f g h i j"
    body = {"messages": [{"role": "user", "content": text}]} if field == "messages" else {"prompt": text}
    r = httpx.post(gw.url + path, json={"model": "narrow", "max_tokens": 2, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == field, err
    assert err["message"].startswith(f"{field}: the prompt"), err


def test_a_prefill_engines_400_frees_the_deployments_slot(gw):
    """A pd deployment whose kv_producer refuses the request passes its 400 on; the slot the
    attempt took of the deployment's max_parallel_requests (1) was never given back, so the
    deployment refused everything after (429) until the reservation expired (timeout + 30 s)."""
    for _ in range(3):
        r = post(gw, "pd400")
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_x_kvserve_pd_describes_the_attempt_that_answered(gw):
    """A pd deployment failed (its prefill and its decode: 500), the retry went to a plain
    deployment of the group; its answer still said x-kvserve-pd: fallback."""
    r = post(gw, "pdmix")
    assert r.status_code == 200 and r.headers["x-kvserve-attempts"] == "2", r.text
    assert r.headers["x-kvserve-deployment"] == "pdmix-plain" and "x-kvserve-pd" not in r.headers


def test_numbers_too_big_for_a_float_are_the_backends_or_the_budgets_400_not_a_500(gw):
    """max_tokens or n past a float's range (10**400: JSON has no limit) made the reservation's
    arithmetic raise OverflowError: a 500 for a client's mistake. Now the reservation is bounded:
    a budget refuses it naming max_tokens, else the backend gives its verdict."""
    r = post(gw, "bad", max_tokens=10**400)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text  # the backend's
    for field in ("max_tokens", "n"):
        r = post(gw, "priced", key="sk-budget", **{field: 10**400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded", r.text


def test_a_lone_surrogate_in_a_prompt_is_counted_not_a_500(gw):
    """A prompt with an unpaired surrogate (valid JSON: "\\ud800") crashed the token count
    (httpx encodes JSON as strict UTF-8) on a deployment with max_context: a 500. It is sent
    escaped, as the request itself is."""
    body = {"model": "small", "messages": [{"role": "user", "content": "a \ud800"}], "max_tokens": 2}
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(gw.url + "/v1/chat/completions", content=json.dumps(body), headers=h)
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "small-7", r.text


def test_a_backend_refusing_the_deployments_api_key_is_retried_elsewhere_not_blamed_on_the_client(gw, fault):
    """The gateway sends a backend the deployment's api_key, never the client's; a backend's 401
    (a deployment set up with a wrong key) was passed through: the client was told its own key
    was invalid, and the group's other deployment was never tried. Now it is retried there, and
    with no other deployment the client gets a 502 naming the deployment."""
    before = fault.count("auth-401")
    r = post(gw, "authmix")
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "authmix-ok", r.text
    assert r.headers["x-kvserve-attempts"] == "2" and fault.count("auth-401") == before + 1
    r = post(gw, "authbad")
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    assert "authbad" in r.json()["error"]["message"] and "api_key" in r.json()["error"]["message"]


def test_a_backends_404_is_the_deployments_fault_not_the_clients(gw):
    """A backend's 404 to a chat request (the deployment's model is not the backend's, or its
    base_url misses the route) was passed through: the client read "not found" for an alias the
    gateway lists, and the group's other deployment was never tried. As in LiteLLM, it is now
    a deployment failure: retried elsewhere, counted towards the cooldown, else a 502."""
    r = post(gw, "nfmix")
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "nfmix-ok", r.text
    assert r.headers["x-kvserve-attempts"] == "2"
    r = post(gw, "nfbad")
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    assert "nfbad" in r.json()["error"]["message"] and "404" in r.json()["error"]["message"]
    r = post(gw, "pd404")  # a prefill engine's 404 (prefill_url set up wrong): the decode engine computes
    assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback", r.text


def test_a_pd_retry_reuses_the_first_prefills_lease_and_one_nobody_takes_is_released(gw, fault, producer):
    """A pd deployment's decode failing (5xx) after a good prefill made the next attempt prefill
    again, the first lease held for nobody until lease_s (kv_leases_expired). As the pd-proxy
    does, the retry now hands the same kv_transfer_params to a decode engine behind the same
    prefill_url, and a lease no attempt's decode engine took is released when the gateway
    gives up."""
    before = fault.count("leases")
    r = post(gw, "pdlease")
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "pdlease-ok", r.text
    assert r.headers["x-kvserve-pd"] == "disaggregated" and r.headers["x-kvserve-attempts"] == "2"
    assert fault.count("leases") == before + 1  # one prefill for both attempts
    r = post(gw, "pdleasedown")
    assert r.status_code == 500 and r.headers["x-kvserve-attempts"] == "2", (r.status_code, r.text)
    assert fault.count("leases") == before + 2
    released = producer.wait(2, timeout=1.0)  # the first lease went to pdlease-ok's decode engine
    assert released == [f"lease-{before + 2}"], released


def test_a_prefill_engine_refusing_the_deployments_api_key_means_recompute_not_a_401(gw):
    """A pd deployment whose prefill engine refused the deployment's api_key passed that 401 on
    as the client's mistake; now the decode engine computes the prompt (x-kvserve-pd: fallback)."""
    r = post(gw, "pdauth")
    assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback", r.text
    assert r.json()["choices"][0]["message"]["content"] == " tok tok"


def test_a_200_that_is_no_json_answer_is_a_failed_attempt(gw, fault):
    """A deployment answering 200 with something that is no JSON object (a load balancer's
    maintenance page) was passed to the client as the answer, and charged its reservation;
    it is a failed attempt now: the group's next deployment answers."""
    before = fault.count("html-200")
    r = post(gw, "htmlmix")
    assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "htmlmix-ok", r.text
    assert r.headers["x-kvserve-attempts"] == "2"
    assert r.json()["choices"][0]["message"]["content"] == " tok tok"
    assert fault.count("html-200") == before + 1


def test_backend_4xx_is_passed_through_and_not_retried(gw, fault):
    before = fault.count("bad-400")
    r = post(gw, "bad")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "temperature: must be <= 2"  # the backend's own body
    assert fault.count("bad-400") == before + 1


def test_429_retry_after_is_honoured(gw, fault):
    before = fault.count("fail-429")
    t0 = time.monotonic()
    r = post(gw, "r429")
    err = r.json()["error"]  # (was server_error / upstream_error: a busy backend read as a broken one)
    assert r.status_code == 429 and err["type"] == "requests" and err["code"] == "rate_limit_exceeded", err
    assert r.headers["retry-after"] == "1" and r.headers["x-kvserve-attempts"] == "2"
    assert fault.count("fail-429") == before + 2  # retried once, on the same (only) deployment
    assert time.monotonic() - t0 >= 1.0  # after the backend's Retry-After: 1


def test_a_retry_goes_back_to_a_deployment_only_after_its_retry_after(gw, fault):
    """Only the last failed deployment's Retry-After was kept: a -> 429 (Retry-After: 1), b ->
    429, and the third attempt went back to a at once, a second early. Each deployment's own
    Retry-After holds for the rest of the request now."""
    before = fault.count("fail-429")
    t0 = time.monotonic()
    r = post(gw, "r429pair", num_retries=2)  # a (by weight), then b (not yet tried), then a again
    assert r.status_code == 429 and r.headers["x-kvserve-attempts"] == "3", r.text
    assert fault.count("fail-429") == before + 3
    assert time.monotonic() - t0 >= 1.0  # a was asked again no sooner than it said


def test_a_retry_after_that_is_not_a_finite_number_is_ignored_not_a_500(gw, fault):
    """Retry-After: nan (or inf) parsed as a float: the gateway's own Retry-After for the final
    429 was int(nan) and the client got a 500 internal_error. Such a header is now ignored
    (the gateway's backoff applies), and the client gets the backend's 429."""
    before = fault.count("429-nan")
    r = post(gw, "r429nan")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    assert "retry-after" not in r.headers and fault.count("429-nan") == before + 2  # retried once


def test_client_disconnect_cancels_the_upstream_stream(gw, fault):
    before = fault.stats()["cancelled_streams"]
    body = {"model": "slow", "messages": MSG, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 20
    while fault.stats()["cancelled_streams"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fault.stats()["cancelled_streams"] == before + 1


def test_client_disconnect_cancels_a_non_streaming_upstream_request(fault, tmp_path):
    cfg = {"model_list": [deployment("long", fault.url + "/v1", "hold-20")], "keys": [{"key": KEY}],
           "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path))
    try:
        before = fault.stats()["cancelled_holds"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(g.url + "/v1/chat/completions", json={"model": "long", "messages": MSG},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)  # fmt: skip
        deadline = time.monotonic() + 15
        while fault.stats()["cancelled_holds"] == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fault.stats()["cancelled_holds"] == before + 1  # long before its 20 s were up
        assert "status=499" in g.logs()
    finally:
        g.stop()


def test_usage_chunk_only_when_the_client_asked(gw):
    c = client(gw)
    chunks = list(c.chat.completions.create(model="okgroup", messages=MSG, max_tokens=3, stream=True))
    assert all(ch.usage is None for ch in chunks) and chunks[-1].choices
    chunks = list(c.chat.completions.create(model="okgroup", messages=MSG, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 3


def test_a_backend_writing_crlf_events_streams_through(gw):
    """SSE allows CRLF line ends (sse-starlette, behind many OpenAI-style servers, writes
    them); the gateway looked for LF LF only, read the whole stream without finding a first
    event and failed it as a closed connection (502 after retries)."""
    c = client(gw)
    chunks = list(c.chat.completions.create(model="crlf", messages=MSG, max_tokens=3, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " tok tok tok"
    assert all(ch.usage is None for ch in chunks)  # the usage the gateway asked for is hidden again
    chunks = list(c.chat.completions.create(model="crlf", messages=MSG, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 3


def test_a_last_event_without_its_blank_line_still_reaches_the_client(gw):
    """A backend whose body ended with an event but not the blank line after it (the openai
    client reads such an event): the gateway held it back as incomplete and never sent it, so
    the client's stream ended without its [DONE]."""
    body = {"model": "unterminated", "messages": MSG, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        events = [e for e in r.read().decode().split("\n\n") if e.strip()]
    assert r.status_code == 200 and events[-1] == "data: [DONE]", events[-2:]
    assert len(events) == 4 and all('"usage"' not in e for e in events)  # 2 tokens, the finish, [DONE]


def test_auth_and_model_errors(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "okgroup", "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(gw, "okgroup", key="sk-nope").status_code == 401
    r = post(gw, "nosuch")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(gw, "retry500", key="sk-limited")
    assert r.status_code == 403 and "retry500" in r.json()["error"]["message"]
    r = httpx.post(
        gw.url + "/v1/chat/completions", content=b"{nope", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body:")
    r = httpx.post(
        gw.url + "/v1/chat/completions", json={"messages": MSG}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    ids = [m.id for m in client(gw, "sk-limited").models.list().data]
    assert ids == ["okgroup"]
    assert client(gw, "sk-limited").models.retrieve("okgroup").id == "okgroup"  # was a 404
    with pytest.raises(openai.NotFoundError) as e:  # a model the key may not use is not shown
        client(gw, "sk-limited").models.retrieve("retry500")
    assert e.value.body["code"] == "model_not_found"


def test_a_model_group_alias_is_served_by_its_group(gw):
    """LiteLLM's router_settings.model_group_alias (a name clients send, served by a group) was
    refused at start ("unknown key"). A hidden one is callable but not listed; a key whose
    `models` name the alias may call it by that name only."""
    r = post(gw, "gpt-4o")
    assert r.status_code == 200 and r.headers["x-kvserve-model-group"] == "big", r.text
    assert post(gw, "secret-big").headers["x-kvserve-model-group"] == "big"
    listed = [m.id for m in client(gw).models.list().data]
    assert "gpt-4o" in listed and "big" in listed and "secret-big" not in listed, listed
    assert [m.id for m in client(gw, "sk-alias-only").models.list().data] == ["gpt-4o"]
    assert post(gw, "gpt-4o", key="sk-alias-only").status_code == 200
    refused = post(gw, "big", key="sk-alias-only")
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "model", refused.text
    r = post(gw, "down", fallbacks=["gpt-4o"])  # (a request's own fallbacks may name one: was a 404)
    assert r.status_code == 200 and r.headers["x-kvserve-model-group"] == "big", r.text
    health = httpx.get(
        gw.url + "/health", params={"model": "gpt-4o"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert [e["model"] for e in health.json()["healthy_endpoints"]] == ["big"], health.text  # (was a 404)


def test_fallbacks_go_only_to_models_the_key_may_use(gw, fault):
    """A key limited to `models` got answers from a fallback group it may not call (the
    configured fallbacks and context_window_fallbacks were followed for every key). Now a
    fallback the key may not use is skipped, and the original error stands."""
    ok, ctx400 = fault.count("ok"), fault.count("ctx-400")
    r = post(gw, "down", key="sk-no-fallbacks")  # fallbacks: down -> okgroup
    assert r.status_code == 500 and r.json()["error"]["code"] == "upstream_error", r.text
    assert r.headers["x-kvserve-attempts"] == "2"  # its own retries, no fallback
    r = post(gw, "small", key="sk-no-fallbacks", messages=[{"role": "user", "content": "a b c d e f g"}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = post(gw, "ctx", key="sk-no-fallbacks")  # the backend's own context 400 is passed through
    assert r.status_code == 400 and "maximum context length" in r.text, r.text
    assert fault.count("ok") == ok and fault.count("ctx-400") == ctx400 + 1
    r = post(gw, "down")  # a key that may use okgroup still falls back
    assert r.status_code == 200 and r.headers["x-kvserve-model-group"] == "okgroup", r.text


def test_a_degradation_fallback_only_for_keys_that_may_use_it():
    """The saturation fallback sent any key's requests to the fallback alias, also a key not
    allowed it; such a key's requests stay on their own group (and do not use up the share)."""
    from kvserve.gateway.backends import BackendPool
    from kvserve.gateway.config import parse_config
    from kvserve.gateway.degrade import Degrader
    from kvserve.gateway.metrics import GatewayMetrics
    from kvserve.gateway.saturation import SaturationMonitor

    u = "http://127.0.0.1:9/v1"
    rule = {"threshold": 1.0, "action": "fallback", "fallback": "small", "share": 0.5}
    cfg = parse_config({"model_list": [deployment("big", u, "m"), deployment("small", u, "m")],
                        "router_settings": {"degradation": {"big": rule}}})  # fmt: skip
    metrics = GatewayMetrics()
    monitor = SaturationMonitor(cfg, BackendPool(cfg), ["big"], metrics)
    monitor.readings["big-0"] = 2.0  # (as a poll of a saturated backend sets it)
    d = Degrader(cfg, monitor, metrics)
    assert [d.decide("big", {}, {"big"}) for _ in range(4)] == [None] * 4
    assert [d.decide("big", {}, {"big", "small"}) for _ in range(2)] == [None, "small"]


def test_a_body_over_max_request_bytes_is_a_413(gw, fault):
    """The gateway read any body whole into memory (kvserve serve refuses past its limit)."""
    before = fault.count("ok")
    body = {"model": "okgroup", "messages": [{"role": "user", "content": "x" * 70000}], "max_tokens": 2}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    chunked = (json.dumps(body).encode()[i : i + 8192] for i in range(0, 80000, 8192))  # no content-length
    r = httpx.post(
        gw.url + "/v1/chat/completions", content=chunked, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 413 and fault.count("ok") == before


def test_a_client_leaving_mid_body_is_a_499_not_a_traceback(gw):
    """Starlette raises ClientDisconnect reading the body of a client that hung up; the gateway
    logged it as an unhandled exception with a traceback."""
    leave_mid_body(gw.url, "/v1/chat/completions", f"Authorization: Bearer {KEY}\r\n")
    logs = wait_for_log(gw.logs, "the client left while sending its body")
    assert "/chat/completions: the client left while sending its body (499)" in logs
    assert "Traceback" not in logs and post(gw, "okgroup").status_code == 200


def test_a_request_is_found_in_spend_logs_by_the_request_id_it_was_answered_with(gw):
    """LiteLLM's /spend/logs?request_id=: the spend log kept the gateway's internal id, so a
    request sent with its own X-Request-Id (a client's trace id) could not be found by it."""
    h = {"Authorization": f"Bearer {KEY}", "x-request-id": "spend-trace-7"}
    body = {"model": "okgroup", "messages": MSG, "max_tokens": 2}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=h, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "spend-trace-7", r.text
    m = {"Authorization": f"Bearer {MASTER}"}
    rows = httpx.get(gw.url + "/spend/logs", params={"request_id": "spend-trace-7"}, headers=m).json()
    assert [(x["request_id"], x["model_group"], x["status"]) for x in rows] == [
        ("spend-trace-7", "okgroup", "success")
    ]


def test_the_log_line_gives_the_request_id_as_request_id(gw):
    """The request's log line printed the id before `request_id=` and the model after it
    ("/chat/completions trace-1 request_id=okgroup"): searching the log for request_id=<the id a
    client reports>, as GATEWAY.md says one does, found nothing."""
    h = {"Authorization": f"Bearer {KEY}", "x-request-id": "log-line-46"}
    body = {"model": "okgroup", "messages": MSG, "max_tokens": 2}
    assert httpx.post(gw.url + "/v1/chat/completions", json=body, headers=h, timeout=30).status_code == 200
    logs = wait_for_log(gw.logs, "request_id=log-line-46", timeout=10)
    assert "/chat/completions okgroup request_id=log-line-46 key=" in logs, logs[-2000:]


def test_the_openai_routes_answer_without_v1_as_litellms_proxy_does(gw):
    """LiteLLM's proxy serves its OpenAI routes with and without /v1, and its docs set clients
    up with base_url http://host:4000: a client set up that way for this gateway got a 404 for
    every call. The routes answer without /v1 too, the same way."""
    c = openai.OpenAI(base_url=gw.url, api_key="sk-limited", max_retries=0, timeout=30)
    assert [m.id for m in c.models.list()] == ["okgroup"] and c.models.retrieve("okgroup").id == "okgroup"
    assert c.chat.completions.create(model="okgroup", messages=MSG, max_tokens=2).choices[0].message.content
    assert c.completions.create(model="okgroup", prompt="one two", max_tokens=2).choices[0].text == " tok tok"
    chunks = list(c.chat.completions.create(model="okgroup", messages=MSG, max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.PermissionDeniedError):  # the key's models apply here as well
        c.chat.completions.create(model="retry500", messages=MSG, max_tokens=2)
    h = {"Authorization": "Bearer sk-limited"}
    r = httpx.post(gw.url + "/responses", json={"model": "okgroup", "input": "hi", "previous_response_id": 1},
                   headers=h, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    r = httpx.get(gw.url + "/responses/resp_x", headers=h, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_a_browser_page_on_an_allowed_origin_may_call_the_gateway(gw, fault, tmp_path):
    """The gateway had no CORS at all (kvserve serve has --allowed-origins; LiteLLM's proxy
    allows every origin): a web app's preflight was a 405, so no browser page could call it.
    general_settings.allowed_origins lets the listed origins in; others stay out."""
    settings = {"database": str(tmp_path / "gw.db"), "allowed_origins": ["http://app.test"]}
    cfg = {"model_list": [deployment("okgroup", fault.url + "/v1", "ok")], "keys": [{"key": KEY}],
           "general_settings": settings}  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path), name="cors")
    try:
        url = g.url + "/v1/chat/completions"
        pre = {"origin": "http://app.test", "access-control-request-method": "POST",
               "access-control-request-headers": "authorization,content-type"}  # fmt: skip
        r = httpx.options(url, headers=pre, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.test"
        h = {"origin": "http://app.test", "Authorization": f"Bearer {KEY}"}
        body = {"model": "okgroup", "messages": MSG, "max_tokens": 2}
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.test"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        r = httpx.options(url, headers={**pre, "origin": "http://evil.test"}, timeout=30)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        g.stop()
    r = httpx.options(gw.url + "/v1/chat/completions", headers=pre, timeout=30)  # none configured: none
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_gateway_errors_have_string_codes(gw):
    """error.code is a string everywhere, as kvserve serve answers (these carried the HTTP
    status, an int)."""
    h = {"Authorization": f"Bearer {KEY}"}
    r = post(gw, "retry500", key="sk-limited")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{nope", headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": MSG}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.get(gw.url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    assert "/v1/nothing-here" in r.json()["error"]["message"]
    r = httpx.get(gw.url + "/v1/chat/completions", headers=h)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST", r.headers  # RFC 9110: a 405 names the methods (was none)
    r = httpx.post(
        gw.url + "/admin/keys", json={"rpm": "lots"}, headers={"Authorization": f"Bearer {MASTER}"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"


def test_a_body_sent_as_a_form_is_a_400_naming_its_content_type(gw, fault):
    """`curl -d '{...}'` sends Content-Type application/x-www-form-urlencoded: kvserve serve
    answers 400, the gateway read the body as JSON and served it. Now the same 400 (a body
    without a Content-Type is still read as JSON, as FastAPI reads it)."""
    body = json.dumps({"model": "okgroup", "messages": MSG, "max_tokens": 1}).encode()
    form = "application/x-www-form-urlencoded"
    before = fault.count("ok")
    for path, key in (("/v1/chat/completions", KEY), ("/v1/batches", KEY), ("/admin/keys", MASTER)):
        h = {"Authorization": f"Bearer {key}", "content-type": form}
        r = httpx.post(gw.url + path, content=body, headers=h, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_json", r.text
        assert "Content-Type: application/json" in err["message"] and form in err["message"], err
        assert err["type"] == "invalid_request_error" and err["param"] is None, err
    assert fault.count("ok") == before  # (nothing reached the backend)
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={**h, "content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("prev, kind", [(123, "a number"), ([], "an array"), ({"id": "x"}, "an object")])
def test_a_previous_response_id_that_is_no_string_is_a_400_naming_its_type(gw, prev, kind):
    """A previous_response_id that is not a string was looked up as a gateway id and answered
    previous_response_not_found ("not made through this gateway"); kvserve serve says the
    field has the wrong type, and so does the gateway now."""
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "okgroup", "input": "hi", "previous_response_id": prev}
    r = httpx.post(gw.url + "/v1/responses", json=body, headers=h, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "previous_response_id", r.text
    assert err["code"] == "invalid_value", err
    assert f"must be a string (a response id), got {kind}" in err["message"], err
    r = httpx.post(gw.url + "/v1/responses", json={**body, "previous_response_id": "resp_x"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text


def test_a_body_nested_too_deeply_to_parse_is_a_400_not_a_500(gw):
    """JSON nested past the parser's recursion limit raised RecursionError, not ValueError: a
    500 and a traceback for the client's mistake (chat and the admin API). Now a 400."""
    deep = b"[" * 20_000  # (under the fixture's max_request_bytes)
    for path, key in (("/v1/chat/completions", KEY), ("/admin/keys", MASTER)):
        r = httpx.post(gw.url + path, content=deep, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert "RecursionError" not in gw.logs()


@pytest.mark.parametrize(
    "headers,status",
    [
        ({"x-litellm-api-key": KEY}, 200),
        ({"x-litellm-api-key": f"Bearer {KEY}"}, 200),
        ({"x-litellm-api-key": KEY, "Authorization": "Bearer sk-someone-elses"}, 200),  # (first)
        ({"api-key": KEY}, 200),  # Azure OpenAI's SDKs
        ({"x-api-key": KEY}, 200),  # Anthropic's
        ({"x-goog-api-key": KEY}, 200),
        ({"Ocp-Apim-Subscription-Key": KEY}, 200),
        ({"Authorization": f"Bearer {KEY}", "api-key": "sk-wrong"}, 200),  # Authorization before api-key
        ({"Authorization": f"Basic {KEY}"}, 200),  # (Langfuse's way, which LiteLLM reads)
        ({"Authorization": f"Token {KEY}", "api-key": KEY}, 401),  # (as LiteLLM: Authorization decides)
        ({"api-key": "sk-wrong"}, 401),
    ],
)
def test_the_key_is_read_from_the_headers_litellm_reads_it_from(gw, headers, status):
    """The gateway read the key from `Authorization: Bearer` only: a LiteLLM client sending
    x-litellm-api-key (its Authorization kept for another service) or an Azure / Anthropic SDK
    sending api-key / x-api-key was a 401 with a good key. Now LiteLLM's headers, in its order."""
    body = {"model": "okgroup", "messages": MSG, "max_tokens": 2}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key", r.text


def test_the_admin_api_takes_the_master_key_from_the_same_headers(gw):
    r = httpx.get(gw.url + "/admin/keys", headers={"x-litellm-api-key": MASTER}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.get(gw.url + "/admin/keys", headers={"Authorization": f"Token {MASTER}"}, timeout=30)
    assert r.status_code == 401, r.text  # (any scheme's token was taken as the master key)


def _go_duration(text: str) -> float:
    """OpenAI's x-ratelimit-reset-* ("12ms", "59.5s", "1m0s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def test_key_rpm_limit_gives_429_with_headers(gw):
    oks = [post(gw, "okgroup", key="sk-rpm2") for _ in range(2)]
    assert [r.status_code for r in oks] == [200, 200]
    for r in oks:  # (was absent) the one-minute window is empty again within a minute
        assert 58 <= _go_duration(r.headers["x-ratelimit-reset-requests"]) <= 60, r.headers
    r = post(gw, "okgroup", key="sk-rpm2")
    err = r.json()["error"]  # OpenAI's: the limit's kind as the type (was rate_limit_error)
    assert r.status_code == 429 and err["type"] == "requests" and err["code"] == "rate_limit_exceeded", err
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert int(r.headers["retry-after"]) <= _go_duration(r.headers["x-ratelimit-reset-requests"]) + 1 <= 61
    assert (
        r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    )
    assert len(r.headers["x-request-id"]) == 32  # the gateway's own refusals name the request too


def test_team_limit_is_shared_by_its_keys(gw):
    assert post(gw, "okgroup", key="sk-team-a").status_code == 200
    r = post(gw, "okgroup", key="sk-team-b")
    assert r.status_code == 429 and "team:t" in r.json()["error"]["message"]


def test_parallel_limit(gw):
    async def two():
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "hold", "messages": MSG, "max_tokens": 1}
            h = {"Authorization": "Bearer sk-par1"}
            return await asyncio.gather(*(c.post(gw.url + "/v1/chat/completions", json=body, headers=h)
                                          for _ in range(2)))  # fmt: skip

    codes = sorted(r.status_code for r in asyncio.run(two()))
    assert codes == [200, 429]
    assert post(gw, "okgroup", key="sk-par1").status_code == 200  # the slot came back


def test_deployment_rpm_sends_the_next_request_elsewhere(gw):
    served = {post(gw, "deprpm").headers.get("x-kvserve-deployment") for _ in range(2)}
    assert served == {"deprpm-a", "deprpm-b"}
    r = post(gw, "deprpm")
    assert r.status_code == 429 and "retry-after" in r.headers
    assert r.json()["error"]["type"] == "requests" and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_tpm_limit_429_names_tokens_as_openais_does(gw):
    """OpenAI's 429 says which limit in its type: "tokens" for tokens per minute."""
    assert post(gw, "okgroup", key="sk-tpm5").status_code == 200  # 3 prompt + 2 completion tokens
    r = post(gw, "okgroup", key="sk-tpm5")
    err = r.json()["error"]
    assert r.status_code == 429 and err["type"] == "tokens" and err["code"] == "rate_limit_exceeded", err


def test_a_backends_own_429_type_and_code_are_kept():
    """An OpenAI backend's 429 says "tokens", a quota's insufficient_quota: the client gets those."""
    from kvserve.gateway.errors import upstream_rate_limited

    body = b'{"error": {"message": "quota", "type": "insufficient_quota", "code": "insufficient_quota"}}'
    err = upstream_rate_limited("g: upstream answered 429", body).body()["error"]
    assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota"), err
    err = upstream_rate_limited("g: upstream answered 429", b"<html>busy</html>").body()["error"]
    assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded"), err


def test_an_answer_says_its_cost_and_deployment_in_litellms_headers(gw):
    """LiteLLM's proxy answers with x-litellm-response-cost (its SDK and users' scripts read the
    cost there), x-litellm-model-group and x-litellm-model-id; the gateway sent none."""
    r = post(gw, "pricedhdr")  # 3 prompt words x 0.5 + 2 completion tokens x 0.25 (as "priced")
    assert r.status_code == 200, r.text
    assert float(r.headers["x-litellm-response-cost"]) == 2.0, r.headers
    assert r.headers["x-litellm-model-group"] == "pricedhdr", r.headers
    assert r.headers["x-litellm-model-id"] == r.headers["x-kvserve-deployment"], r.headers


def test_a_request_dearer_than_the_whole_budget_is_a_400_that_says_why(gw):
    r = post(gw, "priced", key="sk-budget", max_tokens=100)  # up to 1.5 + 100 * 0.25 = 26.5 > 5.0
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    err = r.json()["error"]
    assert err["code"] == "budget_exceeded" and err["param"] == "max_tokens", err
    assert "26.5" in err["message"] and "whole budget of 5" in err["message"], err


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": ["a", "b"]},  # ~3 tokens (estimated): 1.5 + 8 x 0.25 = 3.5 a prompt, 5.5 for both
        {"prompt": [[1, 2], [3, 4]]},  # ~5 tokens: 2.5 + 2.0 = 4.5 a prompt, 6.5 for both
        {"prompt": "one two three", "best_of": 2},  # 3 tokens: 1.5 + 2.0 = 3.5 a sample, 5.5 for two
    ],
)
def test_a_batch_or_best_of_reserves_every_sequence_it_may_draw(gw, extra):
    """A completions batch draws max_tokens for each prompt, and best_of draws (and bills)
    every sample; the reservation counted n only, so such a request could cost several times
    what was reserved, and concurrent ones overspend the budget. (sk-budget: 5.0)"""
    body = {"model": "priced", "max_tokens": 8, **extra}
    r = httpx.post(gw.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-budget"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "budget_exceeded" and "x 2 sequences" in err["message"], err


def test_a_request_without_max_tokens_reserves_for_the_longest_context_it_may_reach(gw):
    """Without max_tokens the reservation assumed the group's first deployment's context (10:
    1.5 + 7 x 0.25 = 3.25 of the 5.0 budget), but the request may be routed to the other (100:
    up to 1.5 + 97 x 0.25 = 25.75), so it could cost several times what was reserved."""
    body = {"model": "ctxmix", "messages": MSG}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-budget"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["code"] == "budget_exceeded" and "25.75" in err["message"] and "97 completion" in err["message"]
    )


def test_budget_reserves_then_settles_and_the_admin_api_reports_spend(gw):
    # each request reserves and costs 3 words * 0.5 + 2 tokens * 0.25 = 2.0; the budget is 5.0
    codes = [post(gw, "priced", key="sk-budget").status_code for _ in range(3)]
    assert codes == [200, 200, 400]
    # spent 4.0 of 5.0, and sk-budget has no budget_duration: this was a 429 "retry after 1 s",
    # which no retry ever passed (the official clients retried it twice); now a 400 that says so
    r = post(gw, "priced", key="sk-budget")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "budget_exceeded" and "retry-after" not in r.headers
    # LiteLLM's type and sentence (its users grep for it; was "key: budget 5 is spent, ..."), then why
    name = hashlib.sha256(b"sk-budget").hexdigest()[:12]  # (a key without an alias)
    assert err["type"] == "budget_exceeded", err
    head = f"Budget has been exceeded! Key={name} Current cost: 4.0, Max budget: 5.0;"
    assert err["message"].startswith(head), err
    assert "does not reset (no budget_duration)" in err["message"] and "cost up to 2," in err["message"], err
    m = {"Authorization": f"Bearer {MASTER}"}
    rows = httpx.get(gw.url + "/admin/spend", params={"group_by": "model"}, headers=m).json()["data"]
    assert {
        "model": "priced",
        "requests": 2,
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "spend": 4.0,
    } in rows


def test_admin_keys_create_use_revoke(gw):
    m = {"Authorization": f"Bearer {MASTER}"}
    assert httpx.get(gw.url + "/admin/keys", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    r = httpx.post(gw.url + "/admin/keys", json={"alias": "new", "models": ["okgroup"], "rpm": 5}, headers=m)
    assert r.status_code == 200, r.text
    new, key_hash = r.json()["key"], r.json()["key_hash"]
    assert post(gw, "okgroup", key=new).status_code == 200
    assert post(gw, "big", key=new).status_code == 403
    listed = httpx.get(gw.url + "/admin/keys", headers=m).json()["data"]
    assert new not in json.dumps(listed) and any(k["key_hash"] == key_hash for k in listed)  # hashed only
    assert httpx.post(gw.url + f"/admin/keys/{key_hash}/revoke", headers=m).status_code == 200
    assert post(gw, "okgroup", key=new).status_code == 401
    r = httpx.post(gw.url + "/admin/keys", json={"rpm": "lots"}, headers=m)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("rpm:")
    r = httpx.get(gw.url + "/admin/spend", params={"group_by": "key", "last": "1h"}, headers=m)
    assert r.status_code == 200 and r.json()["data"]
    for bound in ("start", "end"):  # nan matched no row: an empty report, as if nothing was spent
        r = httpx.get(gw.url + "/admin/spend", params={bound: "nan"}, headers=m)
        assert r.status_code == 400 and r.json()["error"]["param"] == bound, r.text


@pytest.mark.parametrize(
    "body, field",
    [('{"max_budget": Infinity}', "max_budget"), ('{"max_budget": NaN}', "max_budget"),
     ('{"rpm": 1' + "0" * 400 + "}", "rpm"), ('{"alias": "a \\ud800"}', "alias"),
     ('{"metadata": {"note": "a \\ud800"}}', "metadata")],
)  # fmt: skip
def test_admin_refuses_a_key_it_could_not_store_or_use(gw, body, field):
    """An infinite budget failed serializing the answer (500, after the key was stored: a key
    nobody was told); an rpm past a float's range was stored and then every request with the
    key was a 500; a lone surrogate in the alias or the metadata could not be stored (500, and a
    traceback logged). Now 400s naming the field, and nothing is created."""
    m = {"Authorization": f"Bearer {MASTER}", "content-type": "application/json"}
    before = len(httpx.get(gw.url + "/admin/keys", headers=m).json()["data"])
    r = httpx.post(gw.url + "/admin/keys", content=body, headers=m)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}:"), r.text
    assert len(httpx.get(gw.url + "/admin/keys", headers=m).json()["data"]) == before


def test_health_readiness_and_metrics(gw):
    assert httpx.get(gw.url + "/health").json() == {"status": "ok"}
    # LiteLLM's liveness paths too: a chart made for its proxy probes these (a 404 restarts the pod)
    for path in ("/health/liveliness", "/health/liveness"):
        assert httpx.get(gw.url + path).json() == {"status": "ok"}, path
    ready = httpx.get(gw.url + "/health/readiness").json()
    with open(gw.config_path) as f:
        listed = len(yaml.safe_load(f)["model_list"])
    assert ready["status"] == "healthy" and len(ready["deployments"]) == listed  # every one, each once
    # a backend refusing the deployment's api_key cannot answer anything: not up (was: it answered)
    assert [d["up"] for d in ready["deployments"] if d["model_name"] == "denied"] == [False]
    assert all(d["up"] for d in ready["deployments"] if d["model_name"] != "denied")
    text = httpx.get(gw.url + "/metrics").text
    assert "kvserve_gateway_requests_total" in text and "kvserve_gateway_attempts_total" in text


def test_cooldown_after_allowed_fails(fault, tmp_path):
    """A deployment cools down after allowed_fails of its own faults; a request every
    deployment answers with a 500 (a poison request, sent again by the client's retries) once
    cooled the whole group for everyone else, and now counts against none of them."""
    u = fault.url + "/v1"
    sick = {"base_url": u, "model": "fail-500"}
    down = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "ok"}  # connection refused
    cfg = {
        "model_list": [{"model_name": "cool", "id": "sick", "backend": {"base_url": u, "model": "fail-500"}},
                       {"model_name": "cool", "id": "well", "backend": {"base_url": u, "model": "ok"}},
                       {"model_name": "solo", "id": "one", "backend": {"base_url": u, "model": "fail-500"}},
                       {"model_name": "poison", "id": "poison-a", "backend": sick},
                       {"model_name": "poison", "id": "poison-b", "backend": sick},
                       {"model_name": "dying", "id": "dying-a", "backend": {**sick, "model": "role-error"}},
                       {"model_name": "dying", "id": "dying-b", "backend": {**sick, "model": "role-error"}},
                       {"model_name": "alldown", "id": "down-a", "backend": down},
                       {"model_name": "alldown", "id": "down-b", "backend": down}],
        "router_settings": {"allowed_fails": 2, "cooldown_time": 120, "retry_backoff_base": 0.01},
        "keys": [{"key": KEY}], "general_settings": {"database": str(tmp_path / "gw.db")},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path))
    try:
        start = fault.count("fail-500")
        for _ in range(40):
            assert post(g, "cool").status_code == 200
            if fault.count("fail-500") - start >= 2:
                break
        cooled_at = fault.count("fail-500")
        assert cooled_at - start == 2
        for _ in range(15):
            r = post(g, "cool")
            assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "well"
        assert fault.count("fail-500") == cooled_at  # zero requests during the cooldown
        # A group's only deployment is never cooled: each request still reaches it (a cooled one
        # would answer 503 for 120 s without asking, however soon the backend recovered).
        for _ in range(3):
            before = fault.count("fail-500")
            assert post(g, "solo").status_code != 503
            assert fault.count("fail-500") > before
        rows = {d["id"]: d for d in httpx.get(g.url + "/health/readiness").json()["deployments"]}
        assert rows["sick"]["cooling_down"] and not rows["well"]["cooling_down"]
        assert not rows["one"]["cooling_down"]
        for _ in range(3):  # the request, not the deployments: answered 500 by both, each time
            r = post(g, "poison")
            assert r.status_code == 500 and r.json()["error"]["code"] == "upstream_error"
        rows = {d["id"]: d for d in httpx.get(g.url + "/health/readiness").json()["deployments"]}
        assert not rows["poison-a"]["cooling_down"] and not rows["poison-b"]["cooling_down"]
        for _ in range(2):  # streams whose first event says the engine died: the deployments' fault
            assert post(g, "dying", stream=True).status_code == 502
        rows = {d["id"]: d for d in httpx.get(g.url + "/health/readiness").json()["deployments"]}
        assert rows["dying-a"]["cooling_down"] and rows["dying-b"]["cooling_down"]
        # a group whose deployments all cool down: 503 with when the first comes back (had none)
        codes = [post(g, "alldown") for _ in range(3)]
        r = codes[-1]
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_deployment", [c.text for c in codes]
        assert 100 <= int(r.headers["retry-after"]) <= 120
    finally:
        g.stop()


def test_tokens_are_counted_on_a_deployment_not_cooling_down(fault, tmp_path):
    """A key with tpm counts the prompt with the group's first deployment's /tokenize. When that
    one hung (here SIGSTOPped), every request waited its connect_timeout (5 s by default) and
    then fell back to the ~4-characters estimate, even with the deployment in cooldown; the
    count now comes from a deployment that is not cooling down."""
    hung = FaultBackend()
    os.kill(hung.proc.pid, signal.SIGSTOP)
    u = fault.url + "/v1"
    cfg = {
        "model_list": [
            {"model_name": "g", "id": "hung", "backend": {"base_url": hung.url + "/v1", "model": "ok",
                                                          "weight": 1000, "connect_timeout": 1,
                                                          "first_byte_timeout": 1, "timeout": 1}},
            {"model_name": "g", "id": "well", "backend": {"base_url": u, "model": "ok", "weight": 0.001}},
        ],
        "router_settings": {"allowed_fails": 1, "cooldown_time": 600, "retry_backoff_base": 0.01},
        "keys": [{"key": "sk-tpm", "tpm": 100000}], "general_settings": {"database": str(tmp_path / "gw.db")},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path))
    try:
        r = post(g, "g", key="sk-tpm")  # "hung" fails its attempt and cools down; "well" answers
        assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "well", r.text
        assert r.json()["usage"]["total_tokens"] == 5  # 3 words + max_tokens 2, settled in the window
        r = post(g, "g", key="sk-tpm")
        assert r.status_code == 200
        # 3 tokens by well's /tokenize (words), not the 9 of the estimate after hung's timeout
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100000 - 5 - 3
    finally:
        g.stop()
        hung.stop()


@pytest.fixture(scope="module")
def db_gw(fault, tmp_path_factory):
    """A gateway whose database the test reaches into (to break it as a disk or an operator
    would)."""
    tmp = tmp_path_factory.mktemp("gw-db")
    db_path = str(tmp / "gw.db")
    cfg = {"model_list": [deployment("okgroup", fault.url + "/v1", "ok")], "keys": [{"key": KEY}],
           "general_settings": {"database": db_path, "master_key": MASTER}}  # fmt: skip
    g = GatewayProcess(cfg, str(tmp))
    db = sqlite3.connect(db_path, timeout=10)
    yield g, db
    g.stop()
    db.close()


def test_an_unexpected_failure_is_a_500_in_openai_shape_logged_once(db_gw):
    """A fault the gateway has no answer for (here its database lost the keys table under it,
    met when a key is not one of the config's) was Starlette's text/plain 'Internal Server
    Error' with uvicorn's traceback; now OpenAI's error shape without the details, the trace in
    the log once, and the gateway goes on serving."""
    g, db = db_gw
    db.execute("ALTER TABLE keys RENAME TO keys_lost")
    db.commit()
    try:
        r = post(g, "okgroup", key="sk-not-in-the-config")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "keys" not in err["message"], err
        assert post(g, "okgroup").status_code == 200
        logs = wait_for_log(g.logs, "no such table: keys")
        assert logs.count("Traceback") == 1 and "no such table: keys" in logs, logs
    finally:
        db.execute("ALTER TABLE keys_lost RENAME TO keys")
        db.commit()
    assert post(g, "okgroup", key="sk-not-in-the-config").status_code == 401


def test_a_failed_spend_write_is_retried_not_the_end_of_the_spend_log(db_gw):
    """One failed batch (SQLite locked past its busy timeout, disk full; here a trigger that
    aborts inserts) ended the spend log's writer task: that batch was lost and nothing was
    written in the background again (other instances sharing the file saw no rows)."""
    g, db = db_gw
    m = {"Authorization": f"Bearer {MASTER}"}
    assert (
        httpx.get(g.url + "/admin/spend", params={"group_by": "key"}, headers=m).status_code == 200
    )  # flushed
    before = db.execute("SELECT COUNT(*) FROM spend").fetchone()[0]
    db.execute("CREATE TRIGGER full BEFORE INSERT ON spend BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    db.commit()
    assert post(g, "okgroup").status_code == 200
    assert "disk full" in wait_for_log(g.logs, "spend log: writing")
    db.execute("DROP TRIGGER full")
    db.commit()
    assert post(g, "okgroup").status_code == 200
    deadline = time.monotonic() + 30
    while db.execute("SELECT COUNT(*) FROM spend").fetchone()[0] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert db.execute("SELECT COUNT(*) FROM spend").fetchone()[0] == before + 2  # both requests, none lost


def test_a_client_gone_before_its_stream_starts_is_still_settled(fault, tmp_path):
    """A client that left between the first event's arrival and the response's start (the
    server's send raising, as uvicorn's does for a closed connection) left the stream's relay
    never started, so its settlement never ran: the key's parallel slot held until the
    reservation TTL, the request counted in flight for ever (a SIGTERM drain waited out its
    whole timeout), the upstream response left open."""
    from starlette.requests import ClientDisconnect

    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    dep = {"model_name": "g", "id": "g-0", "backend": {"base_url": fault.url + "/v1", "model": "ok"}}
    cfg = parse_config({
        "model_list": [dep],
        "keys": [{"key": "sk-par", "max_parallel_requests": 1}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    })  # fmt: skip
    body = json.dumps({"model": "g", "messages": MSG, "max_tokens": 2, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        "headers": [(b"authorization", b"Bearer sk-par"), (b"content-type", b"application/json")],
    }  # fmt: skip

    async def scenario():
        app = build_app(cfg, web_ui=False)
        gw = app.state.gateway.gateway
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop(0)
            await asyncio.Event().wait()  # (the disconnect is seen by send, as uvicorn's)

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client closed the connection")

        with pytest.raises((OSError, ClientDisconnect, RuntimeError)):  # (however the server says it)
            await app(scope, receive, send)
        await asyncio.sleep(0)  # (a settlement scheduled by the close runs)
        try:
            return gw.num_in_flight, gw.router.strategy.in_flight["g-0"]
        finally:
            await app.state.gateway.pool.close()

    assert asyncio.run(scenario()) == (0, 0)


def test_a_gateway_that_does_not_come_up_in_time_is_stopped(monkeypatch, tmp_path):
    """GatewayProcess's failed start (tests/gateway_utils.py) killed the gateway but never
    reaped it, nor closed its log; it is stopped (server_utils.wait_up) now."""
    started: list = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    cfg = {"model_list": [deployment("m", "http://127.0.0.1:1/v1", "ok")],
           "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    with pytest.raises(TimeoutError):
        GatewayProcess(cfg, str(tmp_path), timeout=0.01)
    assert len(started) == 1 and started[0].returncode is not None, started


def test_a_response_is_cancelled_on_the_deployment_its_id_names(gw):
    """POST /v1/responses/{id}/cancel (OpenAI's responses.cancel) was a route 404 at the
    gateway, which the client read as the response's; it goes to the deployment holding it."""
    c = client(gw)
    made = c.responses.create(model="okgroup", input="hi")
    cancelled = c.responses.cancel(made.id)
    assert cancelled.id == made.id  # (the backend's own id, made the gateway's again)
    with pytest.raises(openai.NotFoundError, match="not made through this gateway"):
        c.responses.cancel("resp_nothere")


def test_litellm_metadata_on_the_responses_api_is_taken_out_and_openais_kept(gw):
    """LiteLLM's `metadata` (non-string values: tags, numbers) was taken out of chat requests
    but reached the backend on /v1/responses, whose own metadata allows only strings: kvserve
    serve's 400 for the whole request. Now its LiteLLM entries are taken out there too and the
    string ones (OpenAI's, stored with the response) still reach the backend."""
    h = {"Authorization": f"Bearer {KEY}"}

    def metadata(meta):
        body = {"model": "okgroup", "input": "hi", "metadata": meta}
        r = httpx.post(gw.url + "/v1/responses", json=body, headers=h, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["metadata"]

    assert metadata({"tags": ["a"], "trace_id": 7, "user": "ann"}) == {"user": "ann"}
    assert metadata({"tags": ["a"], "spend_logs_metadata": {"k": "v"}}) is None  # (none left: no field)
    assert metadata({"user": "ann", "topic": "x"}) == {"user": "ann", "topic": "x"}  # OpenAI's, as it came


def test_litellm_proxy_fields_are_the_gateways_never_the_backends(gw, fault):
    """A LiteLLM proxy user's client sends LiteLLM's body fields (extra_body): they reached the
    backend, and kvserve serve refuses a field it does not know with a 400. The gateway takes
    them out; it honours per-request fallbacks, num_retries and disable_fallbacks as LiteLLM
    does (only to models the key may use), and refuses mock_response rather than spend tokens."""
    litellm = {"metadata": {"tags": ["a"], "trace_id": 1}, "tags": ["t"], "user_api_key_alias": "x",
               "mock_response": None, "mock_testing_fallbacks": False,
               "caching": False, "cache": {"no-cache": True}, "num_retries": 1, "fallbacks": ["okgroup"],
               "litellm_metadata": {"k": "v"}, "guardrails": ["g"], "timeout": 30}  # fmt: skip
    r = post(gw, "echo", **litellm)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == ["max_tokens", "messages", "model"]
    before = fault.count("fail-500")
    r = post(gw, "down2")  # no configured fallbacks: 1 retry, then the group's error
    assert r.status_code == 500 and r.headers["x-kvserve-attempts"] == "2", r.text
    r = post(gw, "down2", num_retries=0)
    assert r.status_code == 500 and r.headers["x-kvserve-attempts"] == "1", r.text
    for fallbacks in (["okgroup"], [{"model": "okgroup"}], [{"down2": ["okgroup"]}]):
        r = post(gw, "down2", fallbacks=fallbacks, num_retries=0)
        assert r.status_code == 200 and r.headers["x-kvserve-model-group"] == "okgroup", (fallbacks, r.text)
        assert r.headers["x-kvserve-attempts"] == "2"
    r = post(gw, "down", disable_fallbacks=True)  # its configured fallback (okgroup) is not followed
    assert r.status_code == 500 and r.headers["x-kvserve-attempts"] == "2", r.text
    for body, status, param in (
        ({"fallbacks": ["okgroup"]}, 403, "fallbacks"),  # the key may use down, small, ctx only
        ({"fallbacks": ["nope"]}, 404, "fallbacks"),
        ({"fallbacks": "okgroup"}, 400, "fallbacks"),
        ({"num_retries": -1}, 400, "num_retries"),
        ({"num_retries": True}, 400, "num_retries"),
        ({"mock_response": "hi"}, 400, "mock_response"),
    ):
        r = post(gw, "down", key="sk-no-fallbacks", **body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    assert fault.count("fail-500") == before + 8  # (the refused ones reached no backend)


def test_litellm_cache_switches_bypass_the_response_cache(gw, fault):
    """LiteLLM's `caching: false` and `cache: {"no-cache": true}` (its clients' way to skip the
    proxy's cache) reached the backend as unknown fields; now they bypass the response cache
    as the cache-control header does, and an answer is still cached for the requests after."""
    greedy = {"temperature": 0, "messages": [{"role": "user", "content": "cache me"}]}
    before = fault.count("echo-keys")
    first, again = post(gw, "echo", **greedy), post(gw, "echo", **greedy)
    assert (first.headers["x-kvserve-cache"], again.headers["x-kvserve-cache"]) == ("miss", "hit")
    for switch in ({"caching": False}, {"cache": {"no-cache": True}}, {"cache": {"no-store": True}}):
        r = post(gw, "echo", **greedy, **switch)
        assert r.status_code == 200 and "x-kvserve-cache" not in r.headers, (switch, r.headers)
    assert fault.count("echo-keys") == before + 4  # the miss and the three bypasses
    assert post(gw, "echo", **greedy, cache={"ttl": 60}).headers["x-kvserve-cache"] == "hit"


def test_latency_based_routing_learns_nothing_from_a_clients_mistake_or_leaving(fault, tmp_path):
    """Latency-based routing took a 4xx passed through (the request's own mistake) and a client
    hanging up as the deployment failing: a 10 s penalty in its average, so one malformed or
    cancelled request sent the next ones to the slower deployment. Neither counts now."""
    u = fault.url + "/v1"
    cfg = {
        "model_list": [{"model_name": "lat", "id": "fast", "backend": {"base_url": u, "model": "hold-0.2"}},
                       {"model_name": "lat", "id": "slow", "backend": {"base_url": u, "model": "hold-1"}}],
        "router_settings": {"routing_strategy": "latency-based", "num_retries": 0},
        "keys": [{"key": KEY}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp_path))
    try:
        assert sorted(post(g, "lat").headers["x-kvserve-deployment"] for _ in range(2)) == ["fast", "slow"]
        assert post(g, "lat").headers["x-kvserve-deployment"] == "fast"
        r = post(g, "lat", temperature=5)  # the backend's 400, passed through
        assert r.status_code == 400 and r.headers["x-kvserve-deployment"] == "fast", r.text
        assert post(g, "lat").headers["x-kvserve-deployment"] == "fast"
        before = fault.stats()["cancelled_holds"]
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while "fast" works on it
            body, auth = {"model": "lat", "messages": MSG}, {"Authorization": f"Bearer {KEY}"}
            quick = httpx.Timeout(5, read=0.05)
            httpx.post(g.url + "/v1/chat/completions", json=body, headers=auth, timeout=quick)
        deadline = time.monotonic() + 10
        while fault.stats()["cancelled_holds"] == before:  # (the gateway saw it leave and cancelled)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert post(g, "lat").headers["x-kvserve-deployment"] == "fast"
    finally:
        g.stop()
    assert "Traceback" not in g.logs(), g.logs()
