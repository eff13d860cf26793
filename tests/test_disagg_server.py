"""Prefill/decode disaggregation between real servers: `kvserve pd-proxy` in front of a
kv_producer and a kv_consumer (`kvserve serve --kv-transfer-config`), and what happens when
the transfer goes wrong: an abort while the KV is on the way, a prefill engine killed
mid-transfer, a lease nobody claims, bad parameters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gateway_utils import FaultBackend, leave_mid_body, wait_for_log
from lease_listener import ReleaseListener
from server_utils import ServerProcess, free_port, stop_process, wait_up
from stream_endings import (
    assert_chat_stream_failed,
    assert_drained_at_deadline,
    assert_responses_stream_failed,
    sse_events,
)

PROMPT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in "
    "fixed-size blocks. Continuous batching schedules every step. Hello world! 0123456789 "
) * 3


MSG_PD = [{"role": "user", "content": "a b"}]


def _kv(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "tcp", "kv_role": role, **extra})


def _server(model: str, role: str | None = None, **extra) -> ServerProcess:
    args = ["--kv-cache-memory", "16MiB", "--max-model-len", "512"]
    if role:
        args += ["--kv-transfer-config", _kv(role, **extra)]
    return ServerProcess(model, *args, api_key=None)


class Proxy:
    def __init__(
        self, prefill: str, decode: str | list[str], log=None, *extra: str, timeout: float = 60
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        decodes = [decode] if isinstance(decode, str) else decode
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "pd-proxy", "--prefill", *prefill.split(),
               "--decode", *decodes, "--port", str(self.port), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        # any answer will do (its engines may be down on purpose); a failed start is stopped
        answers = lambda: httpx.get(self.url + "/v1/models", timeout=1) is not None  # noqa: E731
        wait_up(self.proc, answers, timeout, "pd-proxy", self.stop, poll=0.2)

    def stop(self) -> None:
        stop_process(self.proc)


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def _settled(s: ServerProcess) -> bool:
    m = s.metrics()
    return (
        m["kvserve:kv_cache_usage_perc"] == 0
        and m["kvserve:num_requests_running"] == 0
        and m["kvserve:num_requests_waiting"] == 0
    )


def _prefill(s: ServerProcess) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


@pytest.fixture(scope="module")
def pd(tiny_llama_dir):
    prod = _server(tiny_llama_dir, "kv_producer", lease_s=2.0)
    cons = _server(tiny_llama_dir, "kv_consumer", transfer_timeout_s=3.0)
    proxy = Proxy(prod.url, cons.url)
    yield prod, cons, proxy
    proxy.stop()
    for s in (prod, cons):
        s.stop()


def test_proxy_answers_as_one_engine_would(pd):
    """Through the proxy (official openai client, streamed and not), the text equals the decode
    engine's own answer when it computes the prompt itself; the KV travelled; pools settle."""
    prod, cons, proxy = pd
    body = {"model": cons_model(cons), "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    alone = httpx.post(cons.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    before = cons.metrics().get("kvserve:kv_transfers_total", 0)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none")
    raw = client.completions.with_raw_response.create(**body)
    assert raw.headers["x-kvserve-pd"] == "disaggregated"
    assert raw.parse().choices[0].text == alone
    chunks = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone
    chat = {"model": body["model"], "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
    direct = httpx.post(cons.url + "/v1/chat/completions", json={**chat, "temperature": 0}, timeout=60).json()
    via = client.chat.completions.create(**chat, temperature=0)
    assert via.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert cons.metrics()["kvserve:kv_transfers_total"] >= before + 3
    _wait_for(lambda: _settled(prod) and _settled(cons), 2, "both pools back to empty")


def cons_model(s: ServerProcess) -> str:
    return httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_abort_during_transfer_frees_blocks_on_both_engines(pd):
    """The producer is frozen (SIGSTOP) so the consumer's request waits for its KV; the client
    goes away: the consumer frees its blocks within 2 s, and once the producer runs again the
    release message frees the lease within 2 s. While it waits, its prompt tokens still to
    compute (kvserve:num_waiting_prefill_tokens) are the one the producer does not send."""
    prod, cons, _ = pd
    params = _prefill(prod)
    core = prod.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        body = {"prompt": PROMPT, "max_tokens": 40, "stream": True, "kv_transfer_params": params}
        with httpx.Client(timeout=30) as c, c.stream("POST", cons.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            _wait_for(lambda: cons.metrics()["kvserve:num_requests_waiting"] == 1, 5, "waiting for its KV")
            assert cons.metrics()["kvserve:kv_cache_usage_perc"] > 0
            # it will compute the last prompt token alone (it counted the whole prompt)
            assert cons.metrics()["kvserve:num_waiting_prefill_tokens"] == 1
        t0 = time.monotonic()
        _wait_for(lambda: _settled(cons), 2, "the consumer frees the aborted request's blocks")
        assert time.monotonic() - t0 < 2
    finally:
        os.kill(core, signal.SIGCONT)
    _wait_for(lambda: _settled(prod), 2, "the producer frees the lease")
    assert prod.metrics().get("kvserve:kv_leases_expired_total", 0) == 0  # released, not expired


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": MSG_PD, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)  # fmt: skip
def test_a_request_the_decode_engine_refuses_is_not_prefilled(pd, path, extra, param):
    """The prefill body leaves out fields only the decode engine checks: a bad value there was
    prefilled, the decode engine refused it, and the producer held its KV for nobody until
    lease_s. Now the proxy answers the decode engine's 400 before any prefill."""
    prod, cons, proxy = pd
    before = prod.metrics()["kvserve:prompt_tokens_total"]
    r = httpx.post(proxy.url + path, json={"model": cons_model(cons), **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    direct = httpx.post(cons.url + path, json={"model": cons_model(cons), **extra}, timeout=60)
    assert direct.status_code == 400 and direct.json()["error"]["param"] == param  # (its own verdict)
    assert prod.metrics()["kvserve:prompt_tokens_total"] == before  # nothing prefilled
    assert prod.metrics()["kvserve:kv_cache_usage_perc"] == 0  # nothing leased


def test_unclaimed_lease_expires(pd):
    prod, _, _ = pd
    before = prod.metrics().get("kvserve:kv_leases_expired_total", 0)
    _prefill(prod)
    assert prod.metrics()["kvserve:kv_cache_usage_perc"] > 0  # held for a consumer
    _wait_for(lambda: _settled(prod), 4, "the lease (2 s) expires and its blocks free")
    assert prod.metrics()["kvserve:kv_leases_expired_total"] == before + 1


def test_several_prompts_go_to_the_decode_engine_alone(pd):
    """A completions batch (a list of prompts) was prefilled whole: the producer leased every
    prompt's KV but answers one kv_transfer_params, so the other prompts' blocks were held for
    nobody until lease_s (a batch of 100 took 99 leases' worth of the producer's pool). Now the
    decode engine computes it, as it does n > 1; a list of one prompt is still split."""
    prod, cons, proxy = pd
    before = prod.metrics()["kvserve:prompt_tokens_total"]
    prompts = [PROMPT, "Hello " + PROMPT]
    body = {"model": cons_model(cons), "prompt": prompts, "max_tokens": 4, "temperature": 0}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    m = prod.metrics()
    assert m["kvserve:prompt_tokens_total"] == before and m["kvserve:kv_cache_usage_perc"] == 0  # no lease
    direct = httpx.post(cons.url + "/v1/completions", json=body, timeout=60).json()
    assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "decode-only", r.text
    assert [c["text"] for c in r.json()["choices"]] == [c["text"] for c in direct["choices"]]
    one = httpx.post(proxy.url + "/v1/completions", json={**body, "prompt": [PROMPT]}, timeout=60)
    assert one.status_code == 200 and one.headers["x-kvserve-pd"] == "disaggregated", one.text
    _wait_for(lambda: _settled(prod), 2, "the one prompt's lease taken")


def test_transfer_parameters_an_engine_refuses_mean_recompute_not_a_client_400(pd, fault_proxy):
    """In process, over the module's engines. A --prefill engine that refuses the transfer
    parameters the proxy sets itself (a kv_consumer, or one without --kv-transfer-config: set
    up wrong, as one answering 404), or a decode engine that refuses the producer's (a
    producer not in its kv_producers; here the fault backend's, without a digest), had its 400
    passed to every client, naming kv_transfer_params, a field the client never sent; now the
    decode engine computes the prompt (`x-kvserve-pd: fallback`). A 400 about the client's own
    field still stands."""
    from kvserve.disagg.proxy import PDProxy, build_app

    _, cons, _ = pd
    fault = fault_proxy[0]
    body = {"model": cons_model(cons), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}

    async def ask(prefill: str) -> list[httpx.Response]:
        proxy = PDProxy([prefill], [cons.url])
        transport = httpx.ASGITransport(app=build_app(proxy))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60) as c:
                return [
                    await c.post("/v1/completions", json=body),
                    await c.post("/v1/completions", json={**body, "stream": True}),
                    await c.post("/v1/completions", json={**body, "temperature": -1}),
                ]
        finally:
            await proxy.aclose()

    direct = httpx.post(cons.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    for prefill in (cons.url, fault.url):  # (the consumer as its own producer; a producer it refuses)
        whole, streamed, bad = asyncio.run(ask(prefill))
        assert whole.status_code == 200 and whole.headers["x-kvserve-pd"] == "fallback", (prefill, whole.text)
        assert whole.json()["choices"][0]["text"] == direct
        assert streamed.status_code == 200 and streamed.headers["x-kvserve-pd"] == "fallback", streamed.text
        events = [json.loads(e.removeprefix("data: ")) for e in sse_events(streamed.text)[:-1]]
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert text == direct
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text


def test_a_gateway_pd_decode_engine_refusing_the_transfer_means_recompute(pd, fault_proxy, tmp_path):
    """In process: the gateway's pd deployments passed on a decode engine's 400 naming
    kv_transfer_params (a producer it does not pull from: set up wrong; here the fault
    backend's parameters, without a digest) as the client's mistake, naming a field it never
    sent; the pd-proxy asks again without them. Now the gateway does too (x-kvserve-pd:
    fallback), streamed or not; a 400 about the client's own field still stands. And the
    client's own kv_transfer_params are dropped, as the pd-proxy drops them."""
    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    _, cons, _ = pd
    model = cons_model(cons)
    dep = {"base_url": cons.url + "/v1", "model": model, "prefill_url": fault_proxy[0].url + "/v1"}
    cfg = {"model_list": [{"model_name": "pd", "backend": dep}], "keys": [{"key": "sk-pd"}],
           "general_settings": {"database": str(tmp_path / "gw.db")}}  # fmt: skip
    app = build_app(parse_config(cfg), web_ui=False)
    body = {"model": "pd", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    hdr = {"Authorization": "Bearer sk-pd"}

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as c:
            return [
                await c.post("/v1/completions", json=body, headers=hdr),
                await c.post("/v1/completions", json={**body, "stream": True}, headers=hdr),
                await c.post("/v1/completions", json={**body, "temperature": -1}, headers=hdr),
                await c.post("/v1/completions", json={**body, **mine}, headers=hdr),
            ]

    # a client's own kv_transfer_params on a request the decode engine computes alone (several
    # prompts) went to it as sent (here: a 400 naming them); the pd-proxy drops them, as now
    mine = {"prompt": [PROMPT, PROMPT], "kv_transfer_params": {"do_remote_decode": True}}
    whole, streamed, bad, alone = asyncio.run(ask())
    assert alone.status_code == 200 and alone.headers["x-kvserve-pd"] == "decode-only", alone.text
    direct = httpx.post(cons.url + "/v1/completions", json={**body, "model": model}, timeout=60).json()
    assert whole.status_code == 200 and whole.headers["x-kvserve-pd"] == "fallback", whole.text
    assert whole.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    assert streamed.status_code == 200 and streamed.headers["x-kvserve-pd"] == "fallback", streamed.text
    events = [json.loads(e.removeprefix("data: ")) for e in sse_events(streamed.text)[:-1]]
    assert (
        "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == direct["choices"][0]["text"]
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text


@pytest.mark.parametrize(
    "extra, how",
    [
        ({"max_tokens": 0}, "disaggregated"),  # the prompt alone: its KV is still worth moving
        ({"max_tokens": 0, "logprobs": 1}, "decode-only"),  # every prompt position scored on the consumer
        ({"max_tokens": 2, "logprobs": 1}, "decode-only"),
    ],
)
def test_a_prompt_scored_with_echo_is_answered_as_kvserve_serve_answers_it(pd, extra, how):
    """How eval harnesses score a prompt (echo, max_tokens 0, logprobs): the proxy refused
    max_tokens 0, its check blind to the route's echo rule; and echo with logprobs was prefilled
    and its KV leased for a consumer that computes every prompt position itself anyway."""
    prod, cons, proxy = pd
    body = {"model": cons_model(cons), "prompt": PROMPT, "echo": True, "temperature": 0, **extra}
    before = prod.metrics()["kvserve:prompt_tokens_total"]
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["x-kvserve-pd"] == how, r.text
    prefilled = prod.metrics()["kvserve:prompt_tokens_total"] > before
    assert prefilled == (how == "disaggregated")
    direct = httpx.post(cons.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    got = r.json()["choices"][0]
    assert got["text"] == direct["text"] and got["text"].startswith(PROMPT), got
    if "logprobs" in extra:
        assert got["logprobs"]["tokens"] == direct["logprobs"]["tokens"]
        lps = got["logprobs"]["token_logprobs"]
        assert lps[0] is None and lps[1:] == pytest.approx(direct["logprobs"]["token_logprobs"][1:], abs=1e-4)
    _wait_for(lambda: _settled(prod), 2, "no lease left behind")


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"kv_transfer_params": {"do_remote_decode": True}}, "do_remote_decode needs a kv_producer"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "remote_request_id: required"),
        ({"kv_transfer_params": "yes"}, "kv_transfer_params"),
        ({"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "needs n = 1"),
        (
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_request_id": "x",
                    "prompt_digest": "d",
                    "kv_connector": "tcp",
                    "remote_num_tokens": 1,
                    "remote_host": "169.254.169.254",
                    "remote_port": 80,
                }
            },
            "remote_host: 169.254.169.254:80 is not a producer this engine pulls from",
        ),  # fmt: skip
    ],
)
def test_bad_transfer_params_are_400s_naming_the_field(pd, extra, param):
    _, cons, _ = pd
    r = httpx.post(cons.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in err["message"] and "kv_transfer_params" in (err.get("param") or "") + err["message"]


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"prompt": [PROMPT, "Hello " + PROMPT]}, "needs one prompt, got 2"),
        ({"stream": True}, "needs stream false"),
    ],
)
def test_a_producer_refuses_a_prefill_whose_leases_nobody_could_claim(pd, extra, why):
    """A producer asked for several prompts leased each one's KV but answered one set of
    kv_transfer_params, and a streamed answer carries none: those blocks were held for nobody
    until lease_s (kv_leases_expired rose). Now a 400 naming the field, nothing computed."""
    prod, _, _ = pd
    before = prod.metrics()["kvserve:prompt_tokens_total"]
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}, **extra}
    r = httpx.post(prod.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert why in r.json()["error"]["message"]
    m = prod.metrics()
    assert m["kvserve:prompt_tokens_total"] == before and m["kvserve:kv_cache_usage_perc"] == 0


def test_a_consumer_refusing_several_prompts_releases_the_lease_at_once(pd):
    """Every prompt of a batch would have named the one lease; refused, it is released now."""
    prod, cons, _ = pd
    expired = prod.metrics().get("kvserve:kv_leases_expired_total", 0)
    body = {"prompt": [PROMPT, PROMPT], "max_tokens": 2, "kv_transfer_params": _prefill(prod)}
    r = httpx.post(cons.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "needs one prompt" in r.json()["error"]["message"], r.text
    _wait_for(lambda: _settled(prod), 1.5, "the lease (2 s) released, not expired")
    assert prod.metrics().get("kvserve:kv_leases_expired_total", 0) == expired


def test_gateway_pd_deployment(pd, tmp_path):
    """A gateway deployment with `prefill_url` runs each request's prompt on the producer and
    decodes on base_url; the answer equals the decode engine's own."""
    from gateway_utils import GatewayProcess, deployment

    prod, cons, _ = pd
    model = cons_model(cons)
    cfg = {
        "model_list": [deployment("pd", cons.url + "/v1", model, prefill_url=prod.url + "/v1")],
        "keys": [{"key": "sk-pd"}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }
    gw = GatewayProcess(cfg, str(tmp_path))
    try:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0}
        direct = httpx.post(
            cons.url + "/v1/chat/completions", json={**body, "model": model}, timeout=60
        ).json()
        before = cons.metrics().get("kvserve:kv_transfers_total", 0)  # (absent before the first)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-pd")
        raw = client.chat.completions.with_raw_response.create(model="pd", **body)
        assert raw.headers["x-kvserve-pd"] == "disaggregated"
        assert raw.parse().choices[0].message.content == direct["choices"][0]["message"]["content"]
        stream = client.chat.completions.create(model="pd", stream=True, **body)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == direct["choices"][0]["message"]["content"]
        assert cons.metrics()["kvserve:kv_transfers_total"] == before + 2
    finally:
        gw.stop()


def test_responses_and_embeddings_through_the_proxy(pd):
    """A client pointed at the proxy as at `kvserve serve` got 404 for /v1/responses (and GET /
    DELETE of a stored one) and /v1/embeddings; now they go whole to the decode engine, and a
    stored response's id (streamed or not) names that engine, so it can be continued, read
    back and deleted through the proxy."""
    from kvserve.routing.responses_ids import decode_id

    _, cons, proxy = pd
    model = cons_model(cons)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none")
    body = {"model": model, "input": "a b", "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(**body)
    assert decode_id(first.id) is not None and first.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(first.id)  # (a 404 before: no such route)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "a b")]
    with client.responses.create(**body, previous_response_id=first.id, stream=True) as stream:
        done = [ev for ev in stream if ev.type in ("response.completed", "response.incomplete")][0].response
    assert done.previous_response_id == first.id and decode_id(done.id) is not None
    # input_tokens.count was a 405 (GET / DELETE /v1/responses/{id} matched its path); it counts on
    # the engine holding the previous response, as the engine itself counts under its own id
    engine_count = httpx.post(
        cons.url + "/v1/responses/input_tokens",
        json={"model": model, "input": "c", "previous_response_id": decode_id(first.id)[1]}, timeout=30,
    ).json()["input_tokens"]  # fmt: skip
    count = client.responses.input_tokens.count(model=model, input="c", previous_response_id=first.id)
    alone = client.responses.input_tokens.count(model=model, input="c").input_tokens
    assert count.input_tokens == engine_count > alone
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert first.id in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body, previous_response_id="resp_notfromtheproxy")
    assert e.value.response.json()["error"]["code"] == "previous_response_not_found"
    emb = client.embeddings.create(model=model, input=["a b", "c"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0


def test_a_model_is_retrieved_through_the_proxy(pd):
    """OpenAI's models.retrieve (GET /v1/models/{id}) was a 404 from the proxy for every model;
    now the decode engine answers it, a model it does not serve too."""
    _, cons, proxy = pd
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none")
    assert client.models.retrieve(cons_model(cons)).id == cons_model(cons)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    assert "no-such/model" in e.value.response.json()["error"]["message"]


def test_both_engines_and_the_client_see_one_request_id(pd):
    """Each engine made its own X-Request-Id for a request the client sent without one, so its
    prefill and its decode could not be found together in the engines' logs, and the client got
    neither (nor its own back); now the proxy sends one id to both and answers with it."""
    _, cons, proxy = pd
    body = {"model": cons_model(cons), "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for sent in ({}, {"x-request-id": "trace-7"}):
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers=sent, timeout=60)
        rid = r.headers["x-request-id"]
        assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "disaggregated", r.text
        assert rid == sent.get("x-request-id", rid) and r.json()["id"].endswith(rid), (rid, r.json()["id"])


def test_a_consumer_whose_core_dies_releases_the_leases_it_had_not_pulled(pd):
    """The consumer's core dies (SIGKILL) with a request queued that had not asked for its KV
    (the core stopped first): its connector died with it, and the producer held the prompt's
    blocks for nobody until lease_s. Now the API process releases such leases at once. The
    restarted core pulls KV again (the module's later tests need it back anyway)."""
    prod, cons, proxy = pd
    expired = prod.metrics().get("kvserve:kv_leases_expired_total", 0)
    body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": _prefill(prod)}
    core = cons.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, cons.url + "/v1/completions", json=body, timeout=30)
        _wait_for(lambda: cons.metrics()["kvserve:num_waiting_prefill_tokens"] > 0, 5, "queued")
        os.kill(core, signal.SIGKILL)
        r = answer.result()
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    _wait_for(lambda: _settled(prod), 1.5, "the lease (2 s) released, not expired")
    assert prod.metrics().get("kvserve:kv_leases_expired_total", 0) == expired
    _wait_for(lambda: httpx.get(cons.url + "/health", timeout=5).status_code == 200, 60, "the core back")
    again = httpx.post(proxy.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert again.status_code == 200 and again.headers["x-kvserve-pd"] == "disaggregated", again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # (pulled, not computed)


def test_killed_prefill_engine_means_recompute_not_failure(pd):
    """The producer's engine dies while the consumer waits on its KV: after the transfer
    timeout (3 s) the consumer computes the prompt and answers exactly as it would alone. A
    proxy whose prefill engine is gone falls back the same way. (Last: it ends the producer.)"""
    prod, cons, _ = pd
    params = _prefill(prod)
    core = prod.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    failures = cons.metrics().get("kvserve:kv_transfer_failures_total", 0)
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    alone = httpx.post(cons.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.Client(timeout=60) as c:
        with c.stream(
            "POST",
            cons.url + "/v1/completions",
            json={**body, "stream": True, "kv_transfer_params": params},
        ) as r:
            _wait_for(lambda: cons.metrics()["kvserve:num_requests_waiting"] == 1, 5, "waiting for its KV")
            os.kill(core, signal.SIGKILL)
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == alone
    assert cons.metrics()["kvserve:kv_transfer_failures_total"] == failures + 1
    prod.stop()
    proxy = Proxy(prod.url, cons.url)  # nothing listens there any more
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback"
        assert r.json()["choices"][0]["text"] == alone
    finally:
        proxy.stop()
    _wait_for(lambda: _settled(cons), 2, "the consumer's pool is empty")


def test_proxy_ends_a_stream_its_decode_engine_broke_off_as_kvserve_serve_does():
    """No engines needed. A decode engine dying mid-stream got the client an error event and no
    `data: [DONE]` (kvserve serve sends its error event, then [DONE]: clients reading to [DONE]
    waited), and a Responses stream got chat's error shape. Now chat's error event and [DONE]; a
    Responses stream its own numbered error event (after created and two deltas: 3), no [DONE]."""
    dead = f"http://127.0.0.1:{free_port()}"
    fault = FaultBackend()  # its model "die" streams, then drops the connection
    proxy = Proxy(dead, fault.url)
    try:
        body = {"model": "die", "prompt": "a b", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert_chat_stream_failed(sse_events(r.read()), "mid-stream")
        body = {"model": "die", "input": "a b", "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/responses", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert_responses_stream_failed(sse_events(r.read()), 3, "mid-stream")
    finally:
        proxy.stop()
        fault.stop()


def test_a_helper_process_that_does_not_come_up_in_time_is_stopped(monkeypatch):
    """Proxy() (this module's pd-proxy helper) raised TimeoutError with its process still
    running: it outlived the test run. Now every helper that starts a process stops it when
    the start fails (server_utils.wait_up)."""
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError):
        Proxy(dead, dead, timeout=0.01)
    with pytest.raises(TimeoutError):
        FaultBackend(timeout=0.01)
    assert len(started) == 2 and all(p.poll() is not None for p in started), started


def test_proxy_serves_kvserve_serves_other_routes_from_a_decode_engine():
    """No engines needed. The proxy served /v1/... generation, models and /health only: its
    pod's readiness probe (/health/ready), vLLM's /ping, /tokenize (how the gateway counts a
    deployment's tokens), /detokenize, /version and cancelling a stored Response were 404s,
    and liveness had only /health, 503 while no engine answers (a liveness probe on it
    restarted a healthy proxy). Now a decode engine answers them (the one the Response id
    names, for cancel), /health/liveliness the proxy itself; a path kvserve serve has not either
    is still a 404 in OpenAI's shape."""
    from kvserve.disagg.whole import engine_tag
    from kvserve.routing.responses_ids import encode_id

    dead = f"http://127.0.0.1:{free_port()}"
    fault = FaultBackend()
    proxy, down = Proxy(dead, [dead, fault.url]), Proxy(dead, dead)
    try:
        r = httpx.post(proxy.url + "/tokenize", json={"prompt": "a b c"}, timeout=30)
        assert r.status_code == 200 and r.json()["count"] == 3, r.text
        r = httpx.post(proxy.url + "/detokenize", json={"tokens": [1, 2]}, timeout=30)
        assert r.status_code == 200 and r.json() == {"prompt": "w w"}, r.text
        assert httpx.get(proxy.url + "/version", timeout=30).json() == {"version": "fault"}
        for method in ("GET", "POST"):
            assert httpx.request(method, proxy.url + "/ping", timeout=30).status_code == 200
        r = httpx.get(proxy.url + "/health/ready", timeout=30)
        assert r.status_code == 200 and r.json() == {"decode": [False, True]}, r.text
        r = httpx.get(down.url + "/health/ready", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
        assert httpx.get(down.url + "/health", timeout=30).status_code == 503  # (no decode engine)
        for path in ("/health/liveliness", "/health/liveness"):  # liveness: the process answers
            r = httpx.get(down.url + path, timeout=30)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        public = encode_id(engine_tag(fault.url), "resp_abc")
        r = httpx.post(proxy.url + f"/v1/responses/{public}/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == public, r.text  # (the engine's id made public)
        r = httpx.post(proxy.url + "/v1/responses/resp_nothere/cancel", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        for path in ("/metrics", "/v1/nope"):
            r = httpx.get(proxy.url + path, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    finally:
        proxy.stop()
        down.stop()
        fault.stop()


def test_proxy_reports_a_dead_or_dying_decode_engine_in_openai_shape(tmp_path):
    """No engines needed. A decode engine that cannot be reached was a bare 500 (text/plain,
    a traceback in the proxy's log), and one that died mid-stream cut the stream off; now a
    502 naming the engine, and a final SSE error event the official client raises."""
    dead = f"http://127.0.0.1:{free_port()}"
    log_path = tmp_path / "proxy.log"
    with open(log_path, "w") as log:
        proxy = Proxy(dead, dead, log)
        try:
            r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
            assert r.status_code == 502 and r.headers["x-kvserve-pd"] == "fallback", r.text
            err = r.json()["error"]
            assert err["code"] == "upstream_error" and dead in err["message"], err
            r = httpx.get(proxy.url + "/v1/models", timeout=30)
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
            leave_mid_body(proxy.url, "/v1/completions")  # a ClientDisconnect: 499, no traceback
            wait_for_log(log_path.read_text, "the client left while sending its body")
        finally:
            proxy.stop()
        fault = FaultBackend()  # its model "die" streams two events, then drops the connection
        proxy = Proxy(dead, fault.url, log)
        try:
            c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=30)
            text = ""
            with pytest.raises(openai.APIError) as e:
                for chunk in c.completions.create(model="die", prompt="a b", max_tokens=8, stream=True):
                    text += chunk.choices[0].text if chunk.choices else ""
            assert "mid-stream" in str(e.value) and e.value.body["code"] == "upstream_error"
            assert text == " tok tok"
        finally:
            proxy.stop()
        proxy = Proxy(dead + "/v1", fault.url + "/v1/", log)  # as the gateway's URLs are written
        try:  # the proxy asked .../v1/v1/completions: the client got that 404 as its own error
            r = httpx.post(proxy.url + "/v1/completions", json={"model": "ok", "prompt": "a"}, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback", r.text
        finally:
            proxy.stop()
            fault.stop()
    assert "Traceback" not in log_path.read_text()
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "pd-proxy",
        "--prefill",
        "localhost:1",
        "--decode",
        dead,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "error: --prefill: 'localhost:1' must start with http:// or https://"
    ), p.stderr


@pytest.fixture(scope="module")
def fault_proxy(tmp_path_factory):
    """No engines needed: a proxy whose prefill and decode engines are each one that refuses
    connections and the fault backend (tests/fault_backend.py)."""
    fault, dead = FaultBackend(), f"http://127.0.0.1:{free_port()}"
    log_path = tmp_path_factory.mktemp("pd-fault") / "proxy.log"
    with open(log_path, "w") as log:
        proxy = Proxy(f"{dead} {fault.url}", [dead, fault.url], log, "--decode-first-byte-timeout", "0.5")
        yield fault, proxy, dead
        proxy.stop()
        fault.stop()
    assert "Traceback" not in log_path.read_text()


def test_a_client_leaving_a_non_streamed_request_aborts_its_decode(fault_proxy):
    """A streamed request's decode was aborted when the client left, but a non-streamed one's
    went on to its end on the decode engine (here a 20 s hold), its KV and compute spent for
    nobody; now the proxy closes the decode request as the client goes."""
    fault, proxy, _ = fault_proxy
    before = fault.stats()["cancelled_holds"]
    body = {"model": "hold-20", "prompt": "a b", "max_tokens": 2, "n": 2}  # n 2: decode only
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + "/v1/completions", json=body, timeout=0.5)
    _wait_for(lambda: fault.stats()["cancelled_holds"] == before + 1, 15, "the decode is aborted")


def test_a_client_gone_before_its_stream_starts_closes_the_decode_request(fault_proxy):
    """The decode engine's stream had begun (its first event in), but the client's connection
    was gone when the proxy sent the response's start: the relay generator was never started,
    so its `finally` (closing the decode request) never ran, and the decode engine went on
    generating for nobody until garbage collection. Now the decode request is closed however
    the response ends, and the request no longer counts in flight (the drain waited on it)."""
    import asyncio

    from kvserve.disagg.proxy import PDProxy, build_app

    fault, _, _ = fault_proxy
    proxy = PDProxy([fault.url], [fault.url])
    app = build_app(proxy)
    before = fault.stats()["cancelled_streams"]
    # slow: one event every 0.1 s, 30 s in all; n 2: decode only
    body = json.dumps({"model": "slow", "prompt": "a b", "max_tokens": 300, "n": 2, "stream": True}).encode()

    async def run() -> None:
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # (no disconnect message: the send below fails first)

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                raise OSError("the client's connection is closed")

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "scheme": "http"}  # fmt: skip
        try:
            await app(scope, receive, send)
        except Exception:
            pass  # (the server's concern: the client is gone)
        try:
            _wait_for(lambda: fault.stats()["cancelled_streams"] == before + 1, 15, "the decode is closed")
            assert proxy.num_in_flight == 0
        finally:
            await proxy.aclose()

    asyncio.run(run())


def test_a_decode_engine_failing_before_its_first_byte_is_retried_on_another(fault_proxy):
    """With several --decode engines, one refusing connections (or answering 5xx) failed the
    request though another could have answered it; now each is tried once, and when all fail
    the 502 names every engine and why."""
    fault, proxy, dead = fault_proxy
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=30)
    for _ in range(2):  # each engine first in turn
        assert c.completions.create(model="ok", prompt="a b", max_tokens=2).choices[0].text == " tok tok"
        chunks = c.completions.create(model="ok", prompt="a b", max_tokens=2, stream=True)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " tok tok"
    before = fault.count("fail-500")
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="fail-500", prompt="a b", max_tokens=2, n=2)  # n 2: decode only
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_error", e.value.body
    msg = e.value.body["message"]
    assert dead in msg and fault.url in msg and "injected failure" in msg, msg
    assert fault.count("fail-500") == before + 1


@pytest.mark.parametrize(
    "mode, why", [("role-hang", "no first event within 0.5 s"), ("ping-hang", "no first event within 0.5 s"),
                  ("role-error", "the stream began with an error (engine died)")],
)  # fmt: skip
def test_a_decode_stream_is_committed_at_its_first_real_event_within_a_timeout(fault_proxy, mode, why):
    """The decode stream was passed on at its first bytes, chat's opening role chunk or a
    comment, with no timeout but the 600 s total: an engine that hung after them held the
    client, and one whose first event was an error could not be passed over. Now, as in the
    gateway, the stream is the engine's at its answer's first event, within
    --decode-first-byte-timeout; before it the next engine is asked."""
    fault, proxy, dead = fault_proxy
    body = {"model": mode, "messages": MSG_PD, "max_tokens": 2, "stream": True, "n": 2}  # n 2: decode only
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    msg = r.json()["error"]["message"]
    assert f"{fault.url}: {why}" in msg and dead in msg, msg


def test_a_stream_the_engine_refuses_at_its_first_event_is_the_clients_error(fault_proxy):
    """A stream whose first event is the request's own 400 (kvserve serve's invalid_value, e.g.
    allowed_token_ids its grammar refuses at output token 0) was taken as the engine failing:
    the others were asked, then a 502 upstream_error. Every engine would refuse it: the stream
    is passed on as the engine wrote it, as kvserve serve answers it."""
    fault, proxy, _ = fault_proxy
    body = {"model": "role-refused", "messages": MSG_PD, "max_tokens": 2, "stream": True, "n": 2}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text
    err = json.loads(events[-2])["error"]
    assert err["code"] == "invalid_value" and err["param"] == "allowed_token_ids", err


def test_a_lone_surrogate_in_a_prompt_is_sent_on_escaped(fault_proxy):
    """A prompt with an unpaired surrogate ("\\ud800", valid JSON) crashed the proxy (and a
    gateway's pd deployment) re-encoding the body for the engines: httpx's json= is strict
    UTF-8. A 500 text/plain for a valid request; now the engines get it escaped."""
    fault, proxy, _ = fault_proxy
    body = json.dumps({"model": "ok", "prompt": "a \ud800", "max_tokens": 2})
    r = httpx.post(proxy.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " tok tok", r.text


@pytest.mark.parametrize(
    "prev, kind", [(123, "a number"), ([], "an array"), ({}, "an object"), (True, "a boolean")]
)
def test_a_previous_response_id_that_is_no_string_is_a_400_naming_its_type(fault_proxy, prev, kind):
    """A previous_response_id that is not a string (123, [], {}) was looked up as an id and
    answered 400 previous_response_not_found, sending the client looking for a response; kvserve
    serve and the gateway say the field has the wrong type. Now the proxy does too."""
    _, proxy, _ = fault_proxy
    body = {"model": "ok", "input": "hi", "previous_response_id": prev}
    r = httpx.post(proxy.url + "/v1/responses", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "previous_response_id", r.text
    assert err["code"] == "invalid_value", err
    assert f"must be a string (a response id), got {kind}" in err["message"], err
    r = httpx.post(proxy.url + "/v1/responses", json={**body, "previous_response_id": "resp_x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text


def test_the_proxys_refusals_carry_the_request_id_too(fault_proxy):
    """An answer the decode engine gave carried the request's X-Request-Id, but the proxy's own
    400s (a body that is no JSON, a value the decode engine would refuse, an unknown
    previous_response_id) and a prefill engine's 400 had none: the client could not name the
    request whose prefill the engine's log holds."""
    _, proxy, _ = fault_proxy
    cases = [
        ("/v1/completions", b"{nope"),
        ("/v1/completions", json.dumps({"model": "ok", "prompt": "a", "max_tokens": -1}).encode()),
        ("/v1/responses", json.dumps({"model": "ok", "previous_response_id": "resp_x"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "bad-400", "messages": MSG_PD}).encode()),  # prefill's
    ]
    for i, (path, body) in enumerate(cases):
        sent = {"x-request-id": f"pd-refused-{i}", "content-type": "application/json"}
        r = httpx.post(proxy.url + path, content=body, headers=sent, timeout=30)
        assert r.status_code == 400 and r.headers.get("x-request-id") == f"pd-refused-{i}", (path, r.text)


def test_the_batch_api_is_refused_saying_so_not_a_route_404(fault_proxy):
    """files.create through the proxy got "Not Found: POST /v1/files" (reads as a wrong
    base_url); the Batch API is not proxied, and a 404 `unsupported_endpoint` says so."""
    _, proxy, _ = fault_proxy
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as e:
        c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    assert e.value.body["code"] == "unsupported_endpoint" and "Batch API" in e.value.body["message"]
    for method, path in [("POST", "/v1/batches"), ("GET", "/v1/batches/b/x"), ("DELETE", "/v1/files/f")]:
        r = httpx.request(method, proxy.url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_endpoint", (path, r.text)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(fault_proxy):
    """The proxy read any body whole into memory (kvserve serve and the gateway refuse one past
    16 MiB): one client's upload could take the proxy's memory."""
    fault, proxy, _ = fault_proxy
    before = fault.count("ok")
    body = json.dumps({"model": "ok", "prompt": "a" * (17 * 2**20), "max_tokens": 2})
    r = httpx.post(proxy.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert fault.count("ok") == before


def test_a_body_sent_as_a_form_is_a_400_naming_its_content_type(fault_proxy):
    """`curl -d '{...}'` sends Content-Type application/x-www-form-urlencoded: kvserve serve
    answers 400, the proxy read the body as JSON and had both engines serve it."""
    fault, proxy, _ = fault_proxy
    before = fault.count("ok")
    body = json.dumps({"model": "ok", "prompt": "a b", "max_tokens": 2})
    form = "application/x-www-form-urlencoded"
    r = httpx.post(proxy.url + "/v1/completions", content=body, headers={"content-type": form}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and form in err["message"], r.text
    assert fault.count("ok") == before
    r = httpx.post(proxy.url + "/v1/completions", content=body, timeout=30)  # (none sent: read as JSON)
    assert r.status_code == 200, r.text


def test_health_is_ok_while_some_decode_engine_can_answer(fault_proxy):
    """With the decode engines tried in turn, one of two being down (and the prefill engine:
    the decode engine computes the prompt) costs time, not answers; /health said 503, so a
    load balancer took a working proxy out. It is 503 only when no decode engine answers."""
    _, proxy, _ = fault_proxy
    r = httpx.get(proxy.url + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"prefill": [False, True], "decode": [False, True]}, r.text


def test_head_is_answered_as_get_for_monitors(fault_proxy):
    """Uptime monitors and load balancers probe /health with HEAD: the proxy answered 405 (as
    kvserve serve and the gateway did before), so a working proxy was taken out."""
    _, proxy, _ = fault_proxy
    for path in ("/health", "/v1/models"):
        get, head = httpx.get(proxy.url + path, timeout=30), httpx.head(proxy.url + path, timeout=30)
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
    refused = httpx.head(proxy.url + "/v1/completions", timeout=30)
    assert refused.status_code == 405 and refused.headers["allow"] == "POST", refused.headers  # RFC 9110


def test_a_hung_prefill_engine_costs_the_prefill_timeout_not_the_request(fault_proxy):
    """A prefill engine that accepts the connection and never answers (here SIGSTOPped) held
    every request for the proxy's 600 s read timeout before the decode engine computed the
    prompt; --prefill-timeout (60 s by default, 1 s here) bounds it."""
    fault, _, _ = fault_proxy
    hung = FaultBackend()
    os.kill(hung.proc.pid, signal.SIGSTOP)
    proxy = Proxy(hung.url, fault.url, None, "--prefill-timeout", "1")
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "ok", "prompt": "a b", "max_tokens": 2},
                       timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback", r.text
        assert r.json()["choices"][0]["text"] == " tok tok"
    finally:
        proxy.stop()
        os.kill(hung.proc.pid, signal.SIGCONT)
        hung.stop()


def test_a_prefill_engine_that_cannot_be_reached_is_passed_over_for_another(fault_proxy):
    """With several --prefill engines, a request whose turn fell on one that refused the
    connection had the decode engine compute its prompt (x-kvserve-pd: fallback) though another
    prefill engine was up; now the next one is asked."""
    _, proxy, _ = fault_proxy
    body = {"model": "ok", "prompt": "a b", "max_tokens": 2}
    for _ in range(2):  # each prefill engine first in turn
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "disaggregated", r.text


def test_a_non_ascii_header_is_passed_on_as_it_came(fault_proxy):
    """HTTP header values are bytes (Latin-1 as Starlette reads them); the proxy passed the
    client's Authorization and X-Request-Id on as str, which httpx encodes as ASCII: a key
    with a byte past 0x7f was a text/plain 500 and a traceback. They go on as the same bytes."""
    _, proxy, _ = fault_proxy
    h = {"authorization": b"Bearer sk-\xe9", "x-request-id": b"r\xe9"}
    for path, body in (
        ("/v1/completions", {"model": "ok", "prompt": "a", "max_tokens": 2}),
        ("/v1/models", None),
    ):
        r = httpx.request("POST" if body else "GET", proxy.url + path, json=body, headers=h, timeout=30)
        assert r.status_code == 200, r.text


def test_an_unexpected_failure_or_a_bad_path_is_answered_in_openai_shape(caplog):
    """The proxy had no answer for an exception no handler took (here its engine client closed
    under it): Starlette's text/plain 500 with uvicorn's traceback; a body nested too deeply for
    the JSON parser (a client's mistake) was that same 500 and trace; an unknown path was
    FastAPI's {"detail": ...}. Now a 500 in OpenAI's shape with the trace logged once, a 400
    naming the body with nothing logged, and a 404 in OpenAI's shape."""
    import asyncio
    import logging

    from kvserve.disagg.proxy import PDProxy, build_app

    proxy = PDProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:1"])
    app = build_app(proxy)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as c:
            deep = await c.post("/v1/completions", content=b"[" * 100_000)
            missing = await c.post("/v1/nothing", json={})
            with caplog.at_level(logging.ERROR):
                assert not caplog.records  # the client's mistakes logged no error
                await proxy.aclose()  # every engine request now raises RuntimeError
                broken = await c.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
        return [deep, missing, broken]

    deep, missing, broken = asyncio.run(run())
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"], deep.text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", missing.text
    assert broken.status_code == 500, broken.text
    err = broken.json()["error"]
    assert err["code"] == "internal_error" and err["type"] == "internal_error", err
    assert [r.exc_info is not None for r in caplog.records if r.levelno >= logging.ERROR] == [True]


def test_a_prefill_answer_that_is_not_a_json_object_means_recompute(fault_proxy):
    """A prefill engine answering 200 with a JSON list (not an object) raised AttributeError
    reading its kv_transfer_params: a 500 for the client (in the proxy and in a gateway's pd
    deployment). It is a failed prefill like any other: the decode engine computes the prompt."""
    fault, proxy, _ = fault_proxy
    body = {"model": "list-kv", "prompt": "a b", "max_tokens": 2}
    for _ in range(2):  # each prefill engine first in turn (one refuses connections)
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvserve-pd"] == "fallback", r.text
        assert r.json()["choices"][0]["text"] == " tok tok"


def test_a_busy_decode_engine_beside_a_down_one_is_a_503_with_its_retry_after(fault_proxy):
    """One decode engine down (connection refused), the other answering 429 + Retry-After: the
    proxy answered 502 and dropped the Retry-After, so the client retried at once. An engine
    that cannot be reached says nothing against waiting: 503 with the busy one's Retry-After."""
    fault, proxy, dead = fault_proxy
    for _ in range(2):  # each engine first in turn
        body = {"model": "fail-429", "prompt": "a b", "n": 2}  # n 2: decode only
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.headers, r.text)
        assert r.json()["error"]["code"] == "upstream_error" and dead in r.json()["error"]["message"]


@pytest.fixture
def producer_port():
    listener = ReleaseListener()
    yield listener
    listener.close()


def test_a_lease_no_decode_engine_will_pull_is_released_at_once(fault_proxy, producer_port):
    """Every decode engine failed (or was busy) after a successful prefill: the proxy answered
    502 but the producer kept the prompt's blocks until lease_s (kv_leases_expired). Now the
    proxy releases the lease it will not hand on; an answered request's lease is left alone."""
    fault, proxy, _ = fault_proxy
    for mode, status in (("ok", 200), ("fail-500", 502)):
        body = {"model": f"leased-{producer_port.port}-{mode}", "prompt": "a b", "max_tokens": 2}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == status and r.headers["x-kvserve-pd"] == "disaggregated", r.text
    released = producer_port.wait(2, timeout=1.0)
    assert len(released) == 1 and released[0].startswith("lease-"), released


def test_a_client_gone_after_its_prefill_has_the_lease_released(fault_proxy, producer_port):
    """A client that left while its prefill ran got 499 once the prefill answered, and the lease
    the producer made for it was held for nobody until lease_s; now the proxy releases it."""
    from kvserve.disagg.proxy import PDProxy, build_app

    fault, _, _ = fault_proxy
    proxy = PDProxy([fault.url], [fault.url])
    app = build_app(proxy)
    body = json.dumps({"model": f"leased-{producer_port.port}-ok", "prompt": "a b", "max_tokens": 2}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:  # the body, then the client is gone
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "scheme": "http"}  # fmt: skip

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await proxy.aclose()

    asyncio.run(run())
    assert sent[0]["status"] == 499, sent
    assert producer_port.wait(1)[0].startswith("lease-")


def test_sigterm_drains_the_proxy(tmp_path):
    """SIGTERM stopped the proxy as uvicorn stops: readiness stayed true and new requests were
    still taken until it exited. Now it drains as the gateway and kvserve serve do: /health/ready
    503, a new request 503 + Retry-After, the one in flight still answered, then exit 0."""
    fault, log_path, proxy = FaultBackend(), tmp_path / "proxy.log", None
    body = {"model": "hold-2", "prompt": "a b", "max_tokens": 2, "n": 2}  # n 2: decode only
    try:
        with open(log_path, "w") as log:
            proxy = Proxy(fault.url, fault.url, log, "--shutdown-timeout", "60")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, proxy.url + "/v1/completions", json=body, timeout=60)
            _wait_for(lambda: fault.count("hold-2") == 1, 30, "the request reaches the decode engine")
            proxy.proc.send_signal(signal.SIGTERM)
            _wait_for(lambda: httpx.get(proxy.url + "/health/ready").status_code == 503, 30, "not ready")
            refused = httpx.post(proxy.url + "/v1/completions", json={**body, "model": "ok"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert refused.json()["error"]["code"] == "shutting_down", refused.text
            answer = held.result()
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tok tok", answer.text
        assert proxy.proc.wait(30) == 0
        assert fault.count("ok") == 0  # the refused request never reached an engine
    finally:
        if proxy is not None:
            proxy.stop()
        fault.stop()
    assert "Traceback" not in log_path.read_text()


def test_the_proxys_drain_deadline_ends_what_is_still_in_flight(tmp_path):
    """After SIGTERM the proxy waited for every stream however long (a pod outlived its
    terminationGracePeriod until killed, its streams cut with no word). Now at --shutdown-timeout
    a stream still running gets a `shutting_down` error event and [DONE], a request still in its
    prefill a 503 + Retry-After (the prefill engine aborts it), and the process exits."""
    fault, log_path, proxy = FaultBackend(), tmp_path / "proxy.log", None
    stream_body = {"model": "slow", "messages": MSG_PD, "max_tokens": 600, "stream": True, "n": 2}  # ~60 s

    def stream() -> list[str]:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=stream_body, timeout=60) as r:
            return sse_events(r.read())

    try:
        with open(log_path, "w") as log:
            proxy = Proxy(fault.url, fault.url, log, "--shutdown-timeout", "1")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream)
            held = pool.submit(httpx.post, proxy.url + "/v1/completions", timeout=60,
                               json={"model": "hold-60", "prompt": "a b", "max_tokens": 2})  # fmt: skip
            _wait_for(lambda: fault.count("hold-60") == 1 and fault.count("slow") == 1, 30, "both reach it")
            proxy.proc.send_signal(signal.SIGTERM)
            events, answer = streamed.result(), held.result()
        assert_drained_at_deadline(events, answer, "--shutdown-timeout")
        assert proxy.proc.wait(30) == 0
        _wait_for(lambda: fault.stats()["cancelled_holds"] == 1, 15, "the prefill is aborted")
    finally:
        if proxy is not None:
            proxy.stop()
        fault.stop()
    assert "Traceback" not in log_path.read_text()


def test_health_and_readiness_answer_within_a_probes_timeout_when_an_engine_hangs(fault_proxy):
    """A decode engine that accepts connections and never answers kept /health and /health/ready
    waiting 2 s, past a Kubernetes probe's 1 s (its default timeoutSeconds): the proxy was taken
    out (or restarted) while its other decode engine served. Each engine now has a 0.7 s deadline."""
    import asyncio
    import socket

    from kvserve.disagg.proxy import PDProxy, build_app

    fault, _, _ = fault_proxy
    hung = socket.socket()  # the backlog accepts the connection; nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    app = build_app(PDProxy([fault.url], [hung_url, fault.url]))

    async def run() -> list[tuple[httpx.Response, float]]:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as c:
            for path in ("/health", "/health/ready"):
                t0 = time.monotonic()
                r = await c.get(path, timeout=30)
                out.append((r, time.monotonic() - t0))
        return out

    try:
        (health, t_health), (ready, t_ready) = asyncio.run(run())
    finally:
        hung.close()
    assert health.status_code == 200 and health.json()["decode"] == [False, True], health.text
    assert ready.status_code == 200 and ready.json()["decode"] == [False, True], ready.text
    assert t_health < 1.9 and t_ready < 1.9, (t_health, t_ready)  # (the engine's own timeout is 2 s)


def test_a_restarting_decode_engine_does_not_answer_for_the_others(fault_proxy):
    """In process. /tokenize, /detokenize, /version and /v1/models took the first decode engine
    that could be reached, so one restarting (503 engine_dead) failed them while another
    served; now the next is asked, and when every engine fails the last answer comes as it was,
    its Retry-After kept (it was dropped: the client could not tell when to come back)."""
    from kvserve.disagg.proxy import PDProxy, build_app

    fault = fault_proxy[0]

    async def ask(decode: list[str]) -> list[httpx.Response]:
        proxy = PDProxy([fault.url], decode)
        transport = httpx.ASGITransport(app=build_app(proxy))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as c:
                return [
                    await c.post("/tokenize", json={"prompt": "a b c"}),
                    await c.post("/detokenize", json={"tokens": [1, 2]}),
                    await c.get("/version"),
                    await c.get("/v1/models"),
                    await c.get("/v1/models/ok"),
                ]
        finally:
            await proxy.aclose()

    tok, detok, version, models, _ = asyncio.run(ask([fault.url + "/busy", fault.url]))
    assert tok.status_code == 200 and tok.json()["count"] == 3, tok.text
    assert detok.status_code == 200 and detok.json() == {"prompt": "w w"}, detok.text
    assert version.json() == {"version": "fault"}, version.text
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "ok", models.text
    dead = f"http://127.0.0.1:{free_port()}"
    for r in asyncio.run(ask([fault.url + "/busy", dead])):  # busy, then down: the busy one's answer
        assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.text)
        assert r.json()["error"]["code"] == "engine_dead", r.text
