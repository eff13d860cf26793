"""A real `kvserve serve` process driven with the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.anyio

MODEL_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture()
async def aclient(server):
    # Closed inside the test's event loop: a client left to the garbage collector would try
    # to close its connections on a loop that no longer exists.
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    yield c
    await c.close()


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()


def test_head_answers_as_get_without_a_body(server):
    """Uptime monitors and load balancers probe with HEAD: each GET route answers it with the
    GET's status and headers and no body (was 405); a POST-only route still refuses it."""
    auth = {"Authorization": f"Bearer {server.api_key}"}
    for path in ("/health", "/health/ready", "/v1/models", "/metrics", "/", "/v1/batches"):
        get, head = httpx.get(server.url + path, headers=auth), httpx.head(server.url + path, headers=auth)
        assert (head.status_code, get.status_code) == (200, 200), path
        same_type = head.headers.get("content-type") == get.headers.get("content-type")
        assert head.content == b"" and same_type, path
    assert httpx.head(server.url + "/v1/models").status_code == 401  # the key is still checked
    assert httpx.head(server.url + "/v1/completions", headers=auth).status_code == 405


def test_chat_completion_shape(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello world"}], max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert (
        r.usage.completion_tokens >= 1
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )


def test_chat_stream_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    full = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert full.choices[0].message.content == text


async def test_async_completions_and_stream(aclient):
    r = await aclient.completions.create(model="tiny", prompt="The quick brown", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    stream = await aclient.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=8, temperature=0, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream])
    assert text == r.choices[0].text


def test_n2_list_prompts_and_token_prompts(client):
    r = client.completions.create(model="tiny", prompt="Hello", n=2, max_tokens=6, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    r = client.completions.create(model="tiny", prompt=["Hello", "World"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.prompt_tokens == 5


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=20, temperature=0)
    text = base.choices[0].text
    stop = text.strip()[2:5] if len(text.strip()) > 6 else None
    if not stop:
        pytest.skip("greedy text too short for a stop string")
    r = client.completions.create(
        model="tiny", prompt="The quick brown", max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and text.startswith(r.choices[0].text)


def test_seed_reproducible(client):
    def go(seed):
        return (
            client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert go(7) == go(7)
    assert len({go(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs_and_echo(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))  # greedy
    r = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith("Hello world")
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == r.usage.prompt_tokens + 3
    assert all(x <= 0 for x in lp.token_logprobs[1:])


def test_each_choice_says_which_stop_ended_it_as_vllm(client):
    """vLLM's `stop_reason` (the stop string or stop token id that ended a choice, null for the
    length limit or end of sequence) was missing from every choice and chunk."""
    kw = {"model": "tiny", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    text = client.chat.completions.create(**chat, **kw).choices[0].message.content
    stop = text[3:6]  # the greedy answer is cut there (or where these 3 characters come first)
    cases = [
        (client.chat.completions.create, {**chat, "stop": [stop]}, stop),
        (client.chat.completions.create, chat, None),  # the length limit
        (client.completions.create, {"prompt": "Hello", "stop": ["zzz"]}, None),
    ]
    for create, body, want in cases:
        r = create(**body, **kw)
        assert r.choices[0].model_extra["stop_reason"] == want, (body, r)
        chunks = [c for c in create(**body, stream=True, **kw) if c.choices]
        assert chunks[-1].choices[0].model_extra["stop_reason"] == want
        assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])
    lp = client.completions.create(
        prompt="Hello", logprobs=0, **{**kw, "extra_body": {"return_tokens_as_token_ids": True}}
    )
    third = int(lp.choices[0].logprobs.tokens[2].split(":")[1])
    r = client.completions.create(prompt="Hello", **{**kw, "extra_body": {"stop_token_ids": [third]}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == third, r


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client):
    """echo=true, max_tokens=0 (how evaluation harnesses score a prompt, as OpenAI's legacy
    completions and vLLM answer it) was a 400; it is the prompt with its logprobs, nothing generated."""
    kw = {"model": "tiny", "prompt": ["Hello world", "The cat sat"], "logprobs": 1, "echo": True}
    full = client.completions.create(max_tokens=1, temperature=0, **kw)
    r = client.completions.create(max_tokens=0, **kw)
    assert [c.text for c in r.choices] == ["Hello world", "The cat sat"]
    assert {c.finish_reason for c in r.choices} == {"length"} and r.usage.completion_tokens == 0
    for c, f in zip(r.choices, full.choices):  # the prompt's logprobs, the sampled token not among them
        assert c.logprobs.tokens == f.logprobs.tokens[:-1] and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(f.logprobs.token_logprobs[1:-1], abs=1e-4)
    chunks = list(client.completions.create(max_tokens=0, stream=True, **kw))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)}
    assert streamed == {0: "Hello world", 1: "The cat sat"}
    tokens = [
        t
        for c in chunks
        if c.choices[0].index == 0 and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == r.choices[0].logprobs.tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": "many"}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": "word " * 400}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"suffix": "x"}, "suffix"),
        ({"tools": []}, "tools"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"\u0663": 5}}, "logit_bias"),  # an Arabic-Indic 3: once a bias on token 3
        ({"logit_bias": {"1_0": 5}}, "logit_bias"),  # once token 10
        ({"logit_bias": {" 5": 5}}, "logit_bias"),
        ({"max_tokens": 255}, "max_tokens"),
        # a grammar or regex that matches no text: refused before generation (was 200 with "")
        ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= a\na ::= root"}, "guided_grammar"),  # the field sent
        ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs"),
        # every derivation recurses forever: refused (was generated until max_tokens)
        ({"guided_grammar": 'root ::= "a" root'}, "guided_grammar"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "loop",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                    },
                }
            },
            "response_format",
        ),
    ],
)
def test_bad_requests_are_400(server, body, param):
    payload = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **body}
    r = httpx.post(f"{server.url}/v1/completions", json=payload, headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in err["message"] and err["param"] == param


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": [[5]] * 2049}, "prompt"),  # OpenAI's cap on the list
        ("/v1/completions", {"prompt": [[5]] * 17, "n": 128}, "n"),  # 2,176 sequences
        ("/v1/completions", {"prompt": [[5]] * 17, "n": 1, "best_of": 128}, "best_of"),
    ],
)
def test_fan_out_past_the_sequence_bound_is_400(server, path, body, param):
    """prompts x max(n, best_of) is bounded before anything is tokenized or queued: one body
    of a million short prompts once queued a million engine requests."""
    payload = {"model": "tiny", "max_tokens": 1, **body}
    r = httpx.post(f"{server.url}{path}", json=payload, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and "at most 2048" in err["message"], err
    r = httpx.post(f"{server.url}{path}", json={**payload, "prompt": [[5]] * 16}, headers=server.headers)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16 * payload.get("n", 1)


def test_embeddings_past_2048_inputs_is_400(server, client):
    """As OpenAI's: each input is an engine request, so a 16 MB body of short inputs once queued
    millions of them."""
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input=[[5]] * 2049)
    assert e.value.body["param"] == "input" and "at most 2048" in e.value.body["message"]


def test_openai_client_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(f"{server.url}/v1/nope", headers=server.headers)
    assert r.status_code == 404 and "error" in r.json()


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=server.headers).json()
    assert r["count"] == len(r["tokens"]) > 0
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=server.headers).json()
    assert d["prompt"].endswith("Hello world")
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 10**6]}, headers=server.headers)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("tokens: ids must be in [0, ")


def test_detokenize_refuses_a_body_past_its_own_limit(server):
    """/detokenize took the server's 16 MiB: 4M ids, whose JSON is parsed on the event loop
    (half a second with every stream held). Its limit is a context's worth of ids, at least
    1 MiB (this 256-token model): past it, 413 in OpenAI's shape, declared or chunked."""
    body = b'{"tokens": [' + b"5, " * 400_000 + b"5]}"  # 1.2 MB
    for content in (body, iter([body[: len(body) // 2], body[len(body) // 2 :]])):  # chunked
        r = httpx.post(f"{server.url}/detokenize", content=content, headers=server.headers, timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["message"] == (
            "/detokenize takes a body of at most 1048576 bytes (room for this model's 256-token "
            "context); send the ids in several requests"
        )
    ok = httpx.post(f"{server.url}/detokenize", json={"tokens": [5] * 200_000}, headers=server.headers)
    assert ok.status_code == 200 and ok.json()["prompt"]  # 600 kB: under the limit
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_http_greedy_equals_offline(server, client, tiny_llama_dir):
    prompts = ["Hello world", "A paged KV cache stores keys", "The quick brown fox jumps"]
    llm = LLM(tiny_llama_dir, kv_cache_memory="32MiB", max_model_len=256)
    offline = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ]
    online = [
        client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in prompts
    ]
    assert online == offline


def test_prompt_logprobs_rank_every_prompt_token(server, tiny_llama_dir):
    """vLLM's prompt_logprobs give the prompt token's rank in the vocabulary; ours was None
    for one outside the top ones asked for (always, with prompt_logprobs=0, unless the argmax)."""
    import torch
    from conftest import load_reference

    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 0}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = [int(next(iter(e))) for e in plp[1:]]
    first = httpx.post(f"{server.url}/tokenize", json={"prompt": body["prompt"]}, headers=server.headers)
    ids = [first.json()["tokens"][0], *ids]
    with torch.no_grad():
        rows = load_reference(tiny_llama_dir)(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1]
    ranks = [e[str(t)]["rank"] for e, t in zip(plp[1:], ids[1:])]
    want = [
        range(1 + int((w > w[t] + 1e-4).sum()), 1 + int((w > w[t] - 1e-4).sum()))
        for w, t in zip(rows, ids[1:])
    ]
    assert all(r in w for r, w in zip(ranks, want)), list(zip(ranks, want))
    assert max(ranks) > 1


def test_offline_embed_and_encode_equal_the_servers_embeddings(server, tiny_llama_dir):
    """LLM.embed's vector is the server's /v1/embeddings vector for the same input; vLLM's
    LLM.encode (missing: an AttributeError) gives it as a tensor, and embed took neither vLLM's
    lora_request nor pooling_params (a TypeError): None is accepted, another value named."""
    import torch

    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", max_model_len=256)
    inputs = ["The quick brown fox", [5, 17, 42]]
    for pooling in ("last", "mean"):
        offline = llm.embed(inputs, use_tqdm=False, pooling=pooling, lora_request=None, pooling_params=None)
        for got, one in zip(offline, inputs):  # a text and an id list: one body each, as OpenAI's
            body = {"model": "tiny", "input": one, "pooling": pooling}
            r = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=server.headers, timeout=60)
            assert got.outputs.embedding == pytest.approx(r.json()["data"][0]["embedding"], abs=1e-6)
    encoded = llm.encode(inputs, use_tqdm=False, pooling_task="embed")
    for e, o in zip(encoded, llm.embed(inputs, use_tqdm=False)):
        assert isinstance(e.outputs.data, torch.Tensor) and e.prompt_token_ids == o.prompt_token_ids
        assert e.outputs.data.tolist() == pytest.approx(o.outputs.embedding)
    for field, value in (
        ("pooling_task", "classify"),
        ("lora_request", object()),
        ("pooling_params", object()),
    ):
        with pytest.raises(ValueError, match=f"^{field}: "):
            llm.encode("a", use_tqdm=False, **{field: value})


def test_truncate_prompt_tokens(server):
    """vLLM's truncate_prompt_tokens (completions, chat, embeddings) was a 400 "Extra inputs are
    not permitted". It keeps the prompt's last k tokens (-1: max_model_len) and, as the offline
    LLM, generates up to the context's end; text of any length is cut, not refused."""

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{path}", json={"model": "tiny", **body}, headers=server.headers,
                          timeout=60)  # fmt: skip

    ids = [5 + i % 400 for i in range(300)]
    r = post("completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": -1})
    c = r.json()
    assert (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) == (256, 1), c
    assert c["choices"][0]["finish_reason"] == "length"
    long_text = "The quick brown fox jumps over the lazy dog. " * 80  # past what 256 tokens can hold
    chat = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 3, "temperature": 0}
    assert post("chat/completions", chat).json()["error"]["code"] == "context_length_exceeded"
    r = post("chat/completions", {**chat, "truncate_prompt_tokens": 20})
    assert r.json()["usage"]["prompt_tokens"] == 20, r.text
    e = post("embeddings", {"input": [ids, ids[-3:]], "truncate_prompt_tokens": 3}).json()
    assert e["usage"]["prompt_tokens"] == 6 and e["data"][0]["embedding"] == e["data"][1]["embedding"]
    for bad in (0, -2, 257):
        err = post("completions", {"prompt": "a", "truncate_prompt_tokens": bad}).json()["error"]
        assert err["param"] == "truncate_prompt_tokens", err


async def test_64_concurrent_streams(server, aclient):
    async def one(i):
        stream = await aclient.completions.create(
            model="tiny", prompt=f"Request {i}:", max_tokens=24, temperature=0.8, seed=i, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        n = 0
        async for chunk in stream:
            if chunk.choices:
                n += 1
        return n

    counts = await asyncio.gather(*(one(i) for i in range(64)))
    assert all(c > 0 for c in counts)


async def test_disconnects_free_everything(server):
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as http:
        streams = []
        for _ in range(20):
            req = http.build_request(
                "POST", f"{server.url}/v1/completions", json=body, headers=server.headers
            )
            resp = await http.send(req, stream=True)
            streams.append(resp)
        for resp in streams:
            it = resp.aiter_lines()
            for _ in range(3):
                await it.__anext__()
        assert server.metrics()["kvserve:num_requests_running"] > 0
        for resp in streams:
            await resp.aclose()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0:
            break
        await asyncio.sleep(0.1)
    m = server.metrics()
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0


def test_metrics_exposed(server, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    m = server.metrics()
    for name in (
        "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
        "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", "kvserve:request_success_total",
        "kvserve:time_to_first_token_seconds_count", "kvserve:inter_token_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_count", "kvserve:request_queue_time_seconds_count",
        "kvserve:iteration_tokens_count",
    ):  # fmt: skip
        assert name in m, name
    assert m["kvserve:generation_tokens_total"] >= 4


def _aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=5).text
    key = 'kvserve:request_success_total{finished_reason="abort",model_name="tiny"} '
    return next((float(x[len(key) :]) for x in text.splitlines() if x.startswith(key)), 0.0)


def test_a_client_that_goes_away_is_counted_as_an_aborted_request(server):
    """As vLLM's request_success_total{finished_reason="abort"}: the core never reports a
    finish for a request the server ended, so it was counted nowhere (and its last token
    time was kept for good)."""
    before = _aborted(server)
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1


def _post_many(s: ServerProcess, body: dict, n: int, kill_after: float | None = None):
    """n concurrent completions; optionally SIGKILL the engine core after `kill_after` s."""

    async def one(http):
        return await http.post(f"{s.url}/v1/completions", json=body, headers=s.headers)

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(one(http)) for _ in range(n)]
            killed = None
            if kill_after is not None:
                await asyncio.sleep(kill_after)
                os.kill(s.engine_core_pid(), signal.SIGKILL)
                killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            return killed, time.monotonic(), results

    return asyncio.run(scenario())


LONG = {"model": "tiny", "prompt": "Go", "max_tokens": 240, "ignore_eos": True}


def test_request_timeout(tiny_llama_dir):
    # Two seats: requests queue behind each other, and waiting counts toward the timeout.
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--request-timeout", "0.3", "--max-num-seqs", "2")
    try:
        _, _, results = _post_many(s, LONG, 12)
        codes = sorted(r.status_code for r in results)
        assert set(codes) <= {200, 504} and 504 in codes, codes
        timed_out = next(r for r in results if r.status_code == 504)
        assert timed_out.json()["error"]["type"] == "timeout"
        # Streamed, one choice or two: the timeout ends the stream with an error event naming it.
        for extra in ({}, {"n": 2}):
            _, _, streamed = _post_many(s, {**LONG, **extra, "stream": True}, 6)
            events = [e for r in streamed for e in r.text.split("\n\n") if e.startswith("data: {")]
            errors = [json.loads(e[len("data: ") :])["error"] for e in events if '"error"' in e]
            assert errors and {e["type"] for e in errors} == {"timeout"}, extra
            assert all(r.text.rstrip().endswith("data: [DONE]") for r in streamed)
        time.sleep(0.5)
        m = s.metrics()  # the timed-out requests were aborted in the engine
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0
    finally:
        s.stop()


def test_engine_death_is_reported(tiny_llama_dir):
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "1", "--engine-restart-limit", "0")
    try:
        killed, done, results = _post_many(s, LONG, 20, kill_after=0.3)
        codes = [r.status_code for r in results]
        assert any(c >= 500 for c in codes) and set(codes) <= {200, 503}, codes
        assert done - killed < 2.0
        t0 = time.monotonic()
        while httpx.get(f"{s.url}/health").status_code != 503:
            assert time.monotonic() - t0 < 2.0
            time.sleep(0.05)
        r = httpx.post(f"{s.url}/v1/completions", json=LONG, headers=s.headers)
        assert r.status_code == 503 and json.loads(r.text)["error"]["type"] == "engine_dead"
    finally:
        s.stop()


@pytest.mark.slow
def test_cached_tokens_and_reset_prefix_cache(server, client):
    system = "You are a careful assistant. " * 3
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 16 and cached > 0
    assert first.choices[0].message.content == again.choices[0].message.content
    m = server.metrics()
    assert m["kvserve:prefix_cache_hits_total"] >= cached
    assert m["kvserve:prefix_cache_queries_total"] >= 2 * again.usage.prompt_tokens
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401  # needs the key
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=server.headers).status_code == 200
    time.sleep(0.2)
    after = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0


def test_admission_control_under_overload(tiny_llama_dir):
    """4x more requests than running seats + waiting room: each completes or gets 503 + Retry-After."""
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "8", "--max-waiting-requests", "32")
    try:
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 64, "ignore_eos": True}

        async def scenario():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as http:
                return await asyncio.gather(
                    *(http.post(f"{s.url}/v1/completions", json=body, headers=s.headers) for _ in range(160))
                )

        results = asyncio.run(scenario())
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 503}, codes
        rejected = [r for r in results if r.status_code == 503]
        assert rejected and all(r.headers.get("retry-after") for r in rejected)
        assert all(
            r.json()["choices"][0]["finish_reason"] == "length" for r in results if r.status_code == 200
        )
        assert codes.count(200) >= 32  # at least the waiting room's worth got in
        m = s.metrics()
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
    finally:
        s.stop()


def test_priority_over_http(tiny_llama_dir):
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "1", "--scheduling-policy", "priority")
    try:
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 240, "ignore_eos": True, "stream": True}

        started = []  # first-token times seen so far

        async def first_token_time(http, priority: int) -> float:
            req = {**body, "priority": priority}
            t = None
            async with http.stream("POST", f"{s.url}/v1/completions", json=req, headers=s.headers) as r:
                async for line in r.aiter_lines():
                    if t is None and '"text":"' in line and '"text":""' not in line:
                        t = time.monotonic()
                        started.append(t)
            return t

        async def scenario():
            # The last low request waits for 7 others of 240 tokens: on a loaded 2-core machine
            # that can take well over a minute, so the read timeout is generous.
            async with httpx.AsyncClient(timeout=300) as http:
                low = [asyncio.create_task(first_token_time(http, 5)) for _ in range(6)]
                while not started:  # one low request runs (it has streamed), the others wait
                    await asyncio.sleep(0.01)
                sent = time.monotonic()
                high = [asyncio.create_task(first_token_time(http, 0)) for _ in range(2)]
                return await asyncio.gather(*low), await asyncio.gather(*high), sent

        low, high, sent = asyncio.run(scenario())
        still_waiting = [t for t in low if t > sent]  # low requests queued when the high ones came
        assert len(still_waiting) >= 2
        assert max(high) < min(still_waiting)
    finally:
        s.stop()


def test_streamed_logprobs_match_non_streamed(client):
    """Each streamed chunk carries the logprobs of its own tokens, whatever the timing."""
    kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **kw)
    want = [(t.token, t.logprob) for t in full.choices[0].logprobs.content]
    got = []
    for chunk in client.chat.completions.create(
        messages=msgs, logprobs=True, top_logprobs=2, stream=True, **kw
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            got += [(t.token, t.logprob) for t in chunk.choices[0].logprobs.content]
    # Same tokens; logprobs equal up to float rounding (the second request hits the prefix cache).
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    full = client.completions.create(prompt="Hello world", logprobs=1, echo=True, **kw)
    got_tokens, offsets = [], []
    for chunk in client.completions.create(prompt="Hello world", logprobs=1, echo=True, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            got_tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert got_tokens == full.choices[0].logprobs.tokens  # the echoed prompt's tokens come first
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_a_stop_token_after_part_of_a_character_keeps_its_bytes(client, tiny_llama_dir):
    """A forced token that is the first bytes of a character, which is also a stop token id: as
    in vLLM the ending token's text is left out (the answer is empty) unless
    include_stop_str_in_output, which ends it with U+FFFD (what decoding its tokens gives),
    streamed or not; either way with the token's logprob, finish_reason "stop" and one
    completion token counted."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    part = next(i for i in tok.encode("日本", add_special_tokens=False) if tok.decode([i]) == "\ufffd")
    for include, text in ((False, ""), (True, "\ufffd")):
        kw = dict(
            model="tiny", prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(part): 100}, logprobs=1
        )
        kw["extra_body"] = {"stop_token_ids": [part], "include_stop_str_in_output": include}
        full = client.completions.create(**kw).choices
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert full[0].text == streamed == text
        assert full[0].finish_reason == "stop" and len(full[0].logprobs.tokens) == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == 1


@pytest.mark.parametrize("extra, prompts", [({"n": 4}, 1), ({"n": 2, "prompt_logprobs": 0}, 2)])
def test_n_samples_count_their_prompt_once_in_waiting_prefill_tokens(server, extra, prompts):
    """The n samples of a prompt are forked from one prefill, but each counted the whole prompt
    in kvserve:num_waiting_prefill_tokens (an autoscaler's backlog signal) until it started: an
    n = 4 request read as four prompts. Siblings that cannot fork (prompt_logprobs) compute it
    each. The core is stopped (SIGSTOP) so the count is read while the request is queued."""
    prompt = "n samples share one prefill, " * 4
    hdr = server.headers
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, headers=hdr, timeout=30)
    count = tokenized.json()["count"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 1, "seed": 7, **extra}
    core = server.engine_core_pid()

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            os.kill(core, signal.SIGSTOP)
            try:
                task = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=body, headers=hdr))
                t0 = time.monotonic()
                while not (waiting := server.metrics()["kvserve:num_waiting_prefill_tokens"]):
                    assert time.monotonic() - t0 < 10, "the request never queued"
                    await asyncio.sleep(0.02)
            finally:
                os.kill(core, signal.SIGCONT)
            return waiting, await task

    waiting, r = asyncio.run(scenario())
    assert r.status_code == 200 and len(r.json()["choices"]) == extra["n"], r.text
    assert waiting == count * prompts
    assert server.metrics()["kvserve:num_waiting_prefill_tokens"] == 0
