"""What real clients send beyond the core fields (issue: OpenAI compatibility), against a live
`kvserve serve` on the default model, through the official `openai` SDK where it has the call
and raw HTTP where the point is a header or a status."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import time

import httpx
import numpy as np
import openai
import pytest

ORIGIN = "http://app.example"  # the one compat_server (conftest.py) allows


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


def test_default_model_answers_and_logs_its_configuration(server, client):
    """What `make serve` starts: the default model, with its configuration and KV pool logged."""
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0,
    )  # fmt: skip
    assert "Paris" in r.choices[0].message.content
    text = server.log_file.read_text()
    assert "configuration:" in text and "KV pool:" in text and "max concurrency at max_model_len" in text
    assert "Traceback" not in text


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**server.headers, **headers}, timeout=180)


HI = [{"role": "user", "content": "Say hello."}]


def test_informational_fields_are_accepted(client):
    r = client.chat.completions.create(
        model="smol", messages=HI, max_tokens=3, store=False, metadata={"team": "a"},
        service_tier="auto", reasoning_effort="low", prompt_cache_key="k1", safety_identifier="u1",
        verbosity="low", modalities=["text"], prediction={"type": "content", "content": "Hello"},
        extra_body={"request_id": "abc-1", "chat_template_kwargs": {"enable_thinking": False},
                    "return_tokens_as_token_ids": False, "stream_options": None,
                    "spaces_between_special_tokens": True},  # vLLM's default: was "Extra inputs"
    )  # fmt: skip
    assert r.choices[0].message.content and r.id == "chatcmpl-abc-1"


def test_every_answer_names_its_configuration_and_tier(client):
    """OpenAI's system_fingerprint (LangChain copies it into response_metadata) and chat's
    service_tier were missing from every response and chunk: null through the SDK."""
    kw = {"model": "smol", "max_tokens": 2, "temperature": 0}
    chat = client.chat.completions.create(messages=HI, service_tier="flex", **kw)
    chunks = list(client.chat.completions.create(messages=HI, stream=True, **kw))
    text = client.completions.create(prompt="Hi", **kw)
    text_chunks = list(client.completions.create(prompt="Hi", stream=True, **kw))
    response = client.responses.create(model="smol", input="Hi", max_output_tokens=16)
    fingerprints = {chat.system_fingerprint, text.system_fingerprint}
    fingerprints |= {c.system_fingerprint for c in chunks + text_chunks}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")
    assert {chat.service_tier, response.service_tier} | {c.service_tier for c in chunks} == {"default"}
    assert "service_tier" not in text.model_dump(exclude_unset=True)  # not in OpenAI's Completion


def test_a_response_echoes_the_request_values_openai_echoes(client):
    """top_logprobs, user, safety_identifier, prompt_cache_key(_retention), background and
    reasoning were missing from the Response object: the SDK read null for each, even for a
    value the request set."""
    kw = {"model": "smol", "input": "Hi", "max_output_tokens": 2, "top_logprobs": 2, "user": "u1",
          "safety_identifier": "s1", "prompt_cache_key": "k1", "prompt_cache_retention": "24h"}  # fmt: skip
    made = client.responses.create(**kw)
    streamed = list(client.responses.create(stream=True, **kw))[-1].response
    for r in (made, streamed, client.responses.retrieve(made.id)):
        assert (r.top_logprobs, r.user, r.safety_identifier, r.prompt_cache_key) == (2, "u1", "s1", "k1")
        assert r.prompt_cache_retention == "24h" and r.background is False and r.reasoning.effort is None
    bare = client.responses.create(model="smol", input="Hi", max_output_tokens=2)
    assert (bare.top_logprobs, bare.user, bare.prompt_cache_key) == (0, None, None)


def test_max_tokens_beside_max_completion_tokens_is_ignored_saying_so(server):
    """vLLM's rule (the newer name is the limit), but the ignored value was dropped silently."""
    body = {"model": "smol", "messages": HI, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 9, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "max_tokens (9) ignored: max_completion_tokens (3)" in r.headers["warning"]
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 3, "max_completion_tokens": 3})
    assert r.status_code == 200 and "warning" not in r.headers


def test_the_fingerprint_changes_with_what_changes_the_tokens():
    from kvserve.config import EngineConfig
    from kvserve.entrypoints.openai.fingerprint import system_fingerprint

    base = system_fingerprint(EngineConfig(), "/m")
    assert base == system_fingerprint(EngineConfig(max_num_seqs=3), "/m")  # no effect on the tokens
    for other in (EngineConfig(dtype="bfloat16"), EngineConfig(quantization="int8")):
        assert system_fingerprint(other, "/m") != base
    assert system_fingerprint(EngineConfig(), "/other") != base


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),  # was named modalities, not sent
        ({"web_search_options": {}}, "web_search_options"),
        ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # no chunk carried them: dropped
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_fields_that_change_behaviour_are_refused_with_a_reason(server, extra, field):
    r = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": []}, "tools"),  # OpenAI: "empty array. Expected an array with minimum length 1"
        ({"functions": []}, "functions"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),  # OpenAI: "only allowed when tools ..."
        ({"parallel_tool_calls": True, "tools": []}, "tools"),
    ],
)
def test_tool_fields_without_tools_are_refused_as_openai_does(client, extra, field):
    """Each was answered 200 with the tools ignored; OpenAI refuses them with a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=HI, max_tokens=2, **extra)
    assert e.value.body["param"] == field, e.value.body


def test_responses_take_no_tools_with_parallel_tool_calls_and_echo_them(client):
    """The Responses API takes `tools: []` and parallel_tool_calls without tools (OpenAI's echo
    both in every response): the chat request it runs as must not send them on to be refused."""
    r = client.responses.create(
        model="smol", input="hi", max_output_tokens=2, tools=[], parallel_tool_calls=False
    )
    assert r.status == "incomplete" and r.tools == [] and r.parallel_tool_calls is False


def test_more_stop_strings_than_openai_takes_are_honoured(client):
    """OpenAI takes at most 4 stop strings, vLLM any number: kvserve takes up to 32 (the README),
    so a vLLM client's list of 5 works and each of them stops the text."""
    stop = ["zz1", "zz2", "zz3", "zz4", " 6"]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == " 5,", r.choices[0]


def test_unknown_model_is_404_and_models_retrieve(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HI, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert client.models.retrieve("smol-alias").id == "smol-alias"
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    r = client.completions.create(model="smol-alias", prompt="Once", max_tokens=2)
    assert r.model == "smol-alias"


def test_legacy_functions_map_onto_tools(client, server):
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"model": "smol", "messages": messages, "max_tokens": 40, "temperature": 0, "functions": [fn],
            "function_call": {"name": "get_weather"}}  # fmt: skip
    r = client.chat.completions.create(**call)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "get_weather"
    assert "city" in json.loads(c.message.function_call.arguments)
    assert not c.message.tool_calls
    chunks = list(client.chat.completions.create(**call, stream=True))
    args = "".join(ch.choices[0].delta.function_call.arguments or "" for ch in chunks
                   if ch.choices and ch.choices[0].delta.function_call)  # fmt: skip
    assert json.loads(args) == json.loads(c.message.function_call.arguments)
    assert chunks[-1].choices[0].finish_reason == "function_call"
    # the legacy follow-up: the call and its `function` result are both in the prompt
    turn = {"role": "assistant", "content": None, "function_call": c.message.function_call.model_dump()}
    result = {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}
    bare = {**turn, "function_call": None, "content": ""}
    count = {k: post(server, "/tokenize", {"messages": m}).json()["count"]
             for k, m in {"call": [turn], "none": [bare]}.items()}  # fmt: skip
    assert count["call"] > count["none"] + 5
    follow = client.chat.completions.create(
        model="smol", messages=[*messages, turn, result], functions=[fn], max_tokens=8, temperature=0
    )
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens + count["call"] - count["none"]


def test_guided_aliases_work_with_a_deprecation_warning(server):
    r = post(
        server, "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "guided_choice": ["yes", "no"]}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert "guided_choice" in r.headers["warning"] and "structured_outputs" in r.headers["warning"]
    both = {"messages": HI, "guided_regex": "a+", "structured_outputs": {"regex": "b+"}}
    assert post(server, "/v1/chat/completions", both).status_code == 400


def test_developer_role_replaces_the_default_system_prompt(server):
    msgs = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    dev = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    sys_ = post(server, "/tokenize", {"messages": [{**msgs[0], "role": "system"}, msgs[1]]}).json()["tokens"]
    assert dev == sys_


def test_assistant_prefill_continues_the_last_message(server):
    msgs = [{"role": "user", "content": "What is your name?"}, {"role": "assistant", "content": "My name is"}]
    prefilled = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    closed = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": True}).json()["tokens"]
    tail = httpx.post(f"{server.url}/detokenize", json={"tokens": prefilled[-4:]}, headers=server.headers)
    assert tail.json()["prompt"].endswith("My name is")  # no end-of-turn, no new assistant header
    assert len(closed) > len(prefilled)
    r = post(
        server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0, "echo": True}
    )
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("My name is") and len(content) > len("My name is")
    bad = {"messages": msgs[:1], "continue_final_message": True}
    assert post(server, "/v1/chat/completions", bad).json()["error"]["param"] == "continue_final_message"


def test_stream_events_stay_one_line_for_splitlines_clients(server):
    """Text holding U+0085 / U+2028 / U+2029 (JSON may carry them raw; Python's str.splitlines,
    and so httpx's aiter_lines, breaks lines at them) still arrives one event per line: an
    httpx client parses every event of an echoed prefill that contains all three."""
    odd = "My name\u2028is\x85Bob\u2029and"
    msgs = [{"role": "user", "content": "What is your name?"}, {"role": "assistant", "content": odd}]
    body = {"model": "smol", "messages": msgs, "max_tokens": 3, "echo": True, "stream": True}
    url, content = f"{server.url}/v1/chat/completions", ""
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
    assert content.startswith(odd) and len(content) > len(odd)


def test_tokenize_counts_tools_as_chat_does(server, client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Call f."}]
    counted = post(server, "/tokenize", {"messages": msgs, "tools": tools}).json()["count"]
    empty = post(server, "/tokenize", {"messages": [], "continue_final_message": False})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"  # schemathesis found it
    r = client.chat.completions.create(model="smol", messages=msgs, tools=tools, max_tokens=1)
    assert counted == r.usage.prompt_tokens
    assert counted > post(server, "/tokenize", {"messages": msgs}).json()["count"]


def test_request_id_header_is_echoed_or_generated(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, **{"x-request-id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
    # the same id sent twice at once must not collide inside the engine
    again = post(
        server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 2}, **{"x-request-id": "dup"}
    )
    assert again.status_code == 200 and len(again.json()["choices"]) == 2


def test_ping_cors_and_vllm_metric_names(server):
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    ok = httpx.options(f"{server.url}/v1/chat/completions", headers=pre)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{server.url}/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    m = server.metrics()
    assert m["vllm:num_requests_waiting"] == m["kvserve:num_requests_waiting"]
    assert "vllm:generation_tokens_total" in m


def test_completion_suffix_and_vllm_logprob_extras(server):
    r = post(server, "/v1/completions", {"prompt": "def f(", "suffix": "return x", "max_tokens": 2})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "logprobs": 1,
            "prompt_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    c = post(server, "/v1/completions", body).json()["choices"][0]
    assert all(t.startswith("token_id:") for t in c["logprobs"]["tokens"])
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(
        post(server, "/tokenize", {"prompt": body["prompt"]}).json()["tokens"]
    )
    assert all(isinstance(v["logprob"], float) for e in plp[1:] for v in e.values())


def test_completion_top_logprobs_hold_the_sampled_token(server):
    """OpenAI's legacy completions: "the logprob of the sampled token is always returned, so
    there may be up to logprobs + 1 elements" (vLLM's too). The sampled token was left out when
    outside the top (here forced by a logit bias, which the raw logprobs do not see), and
    logprobs=0 gave {} for every token."""
    forced = post(server, "/tokenize", {"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(forced[0]): 100}}  # fmt: skip
    for k, streamed in ((0, False), (1, False), (1, True)):
        if streamed:
            lp = [ch["logprobs"] for ch in _streamed(server, "/v1/completions", {**body, "logprobs": k})
                  if ch["logprobs"]][0]  # fmt: skip
        else:
            lp = post(server, "/v1/completions", {**body, "logprobs": k}).json()["choices"][0]["logprobs"]
        (token,), (token_lp,), (top,) = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
        assert top.get(token) == token_lp and len(top) == k + 1, (k, lp)
        assert all(v > token_lp for t, v in top.items() if t != token)  # the top one is another


def test_vllm_allowed_token_ids_and_bad_words(server):
    """vLLM's allowed_token_ids and bad_words were a 400 "Extra inputs are not permitted"."""
    ask = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
           "max_tokens": 12, "temperature": 0}  # fmt: skip
    base = post(server, "/v1/chat/completions", ask).json()["choices"][0]["message"]["content"]
    assert "Paris" in base
    r = post(server, "/v1/chat/completions", {**ask, "bad_words": ["Paris"]})
    assert r.status_code == 200 and "Paris" not in r.json()["choices"][0]["message"]["content"], r.text
    ids = post(server, "/tokenize", {"prompt": " yes no", "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": "Is the sky blue?", "max_tokens": 4, "temperature": 0, "allowed_token_ids": ids}
    c = post(server, "/v1/completions", {**body, "ignore_eos": True, "logprobs": 0}).json()["choices"][0]
    assert c["text"] and set(c["text"].split()) <= {"yes", "no"}, c
    for extra, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words"),
                         ({"bad_words": ["x"] * 1025}, "bad_words")):  # fmt: skip
        r = post(server, "/v1/completions", {**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completion_logprobs_given_as_chat_spells_them(server):
    """Clients send chat's boolean logprobs to /v1/completions: false was a 400 (it means none),
    true "logprobs: Input should be a valid integer" (the endpoint's logprobs is a count)."""
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    r = post(server, "/v1/completions", {**body, "logprobs": False})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = post(server, "/v1/completions", {**body, "logprobs": True})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logprobs", r.text
    assert (
        "integer from 0 to the server's --max-logprobs (20" in err["message"]
        and "top_logprobs" in err["message"]
    )


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      headers=server.headers, timeout=180) as r:  # fmt: skip
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_vllm_return_token_ids_and_add_special_tokens(server):
    """vLLM's return_token_ids and add_special_tokens (both endpoints) were a 400 "Extra inputs are
    not permitted". The ids are the prompt the model saw and every token it generated (a cut stop
    string's too, as vLLM's); streamed, the same ids once each, the prompt's with the first chunk.
    chat_template is refused saying why, as vLLM's default refuses it."""
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0, "stop": [" 8"],
            "return_token_ids": True, "add_special_tokens": False}  # fmt: skip
    r = post(server, "/v1/completions", body).json()
    c = post(server, "/tokenize", {"prompt": body["prompt"], "add_special_tokens": False}).json()
    ch = r["choices"][0]
    assert ch["prompt_token_ids"] == c["tokens"] and ch["text"] == " 6, 7,", ch
    assert len(ch["token_ids"]) == r["usage"]["completion_tokens"]
    assert post(server, "/detokenize", {"tokens": ch["token_ids"]}).json()["prompt"].startswith(" 6, 7, 8")
    chunks = [e["choices"][0] for e in _events(server, "/v1/completions", body)]
    assert chunks[0]["prompt_token_ids"] == ch["prompt_token_ids"]
    assert not any("prompt_token_ids" in x for x in chunks[1:])
    assert [t for x in chunks for t in x["token_ids"]] == ch["token_ids"]
    ask = {"messages": HI, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    want = post(server, "/tokenize", {"messages": HI}).json()["tokens"]
    for extra in ({}, {"add_special_tokens": True}):  # (this model's tokenizer adds no BOS)
        r = post(server, "/v1/chat/completions", {**ask, **extra}).json()
        assert r["prompt_token_ids"] == want and len(r["choices"][0]["token_ids"]) == 4, r
    events = _events(server, "/v1/chat/completions", ask)
    assert events[0]["prompt_token_ids"] == want and not any("prompt_token_ids" in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == r["choices"][0]["token_ids"]
    r = post(server, "/v1/chat/completions", {**ask, "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_logprob_bytes_are_the_tokens_own_and_cover_only_the_content(server):
    body = {"messages": [{"role": "user", "content": "Write the word 日本 once."}], "max_tokens": 24,
            "temperature": 0, "logprobs": True, "stop": ["\n"]}  # fmt: skip
    c = post(server, "/v1/chat/completions", body).json()["choices"][0]
    entries = c["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in entries).decode()
    assert joined == c["message"]["content"]  # multi-byte pieces rejoin; no end-of-turn token


def _streamed(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      headers=server.headers, timeout=180) as r:  # fmt: skip
        return [json.loads(x[6:])["choices"][0] for x in r.iter_lines() if x.startswith("data: {")]


def test_completion_logprobs_leave_out_a_cut_stop_string(server):
    """A stop string cut from the text is not in the logprobs either (they listed ' ', '8' after
    the text ' 6, 7,'). Streamed, a token's logprob goes out with its text, so the ' ' held back
    as a possible start of ' 8' was not sent before the match cut it: the stream's text and
    logprobs are the whole answer's."""
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0, "logprobs": 1, "stop": [" 8"]}
    c = post(server, "/v1/completions", body).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == " 6, 7,", c
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"] and len(lp["token_logprobs"]) == len(lp["tokens"])
    chunks = _streamed(server, "/v1/completions", body)
    sent = [ch["logprobs"] for ch in chunks if ch["logprobs"]]
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    assert [t for s in sent for t in s["tokens"]] == lp["tokens"]
    assert [x for s in sent for x in s["token_logprobs"]] == lp["token_logprobs"]
    assert [x for s in sent for x in s["text_offset"]] == lp["text_offset"]


def test_chat_streamed_logprobs_leave_out_a_cut_stop_string(server):
    """Chat as completions: a stop string of several tokens whose first was generated before
    the match completed is in neither the streamed text nor the streamed logprobs."""
    body = {"messages": [{"role": "user", "content": "Count from 1 to 10, comma-separated."}],
            "max_tokens": 30, "temperature": 0, "logprobs": True, "stop": [", 5"]}  # fmt: skip
    c = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"]["content"].endswith("4"), c
    whole = [(e["token"], e["logprob"]) for e in c["logprobs"]["content"]]
    assert "".join(t for t, _ in whole) == c["message"]["content"]
    chunks = _streamed(server, "/v1/chat/completions", body)
    assert "".join(ch["delta"].get("content") or "" for ch in chunks) == c["message"]["content"]
    sent = [(e["token"], e["logprob"]) for ch in chunks if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert sent == whole


def test_continuous_usage_stats(server):
    body = {"prompt": "Count: 1, 2,", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [e["usage"]["completion_tokens"] for e in events if e.get("choices")]
    assert usages == sorted(usages) and usages[-1] == events[-1]["usage"]["completion_tokens"]


def test_continuous_usage_stats_of_a_chat_stream_count_the_prompt_from_its_first_chunk(server):
    """The role chunks went out before any engine output, with prompt_tokens 0 (then the real
    count): vLLM's first chunk already reports the prompt, as the final usage does."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Count: 1, 2,"}], "max_tokens": 3,
            "n": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    final = events[-1]["usage"]
    assert not events[-1]["choices"] and final["prompt_tokens"] > 0
    roles = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 2
    for e in events:
        assert e["usage"]["prompt_tokens"] == final["prompt_tokens"], e
        assert e["usage"]["total_tokens"] == final["prompt_tokens"] + e["usage"]["completion_tokens"]
    assert [e["usage"]["completion_tokens"] for e in roles] == [0, 0]


def test_responses_multi_turn_with_previous_response_id(client):
    first = client.responses.create(
        model="smol", input="My name is Ada. Reply with one word.", max_output_tokens=8, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.responses.create(
        model="smol",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    # the second turn's prompt holds the first turn (its input and output) before the new input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smol", input="Hi", previous_response_id=first.id)
    # OpenAI's code (was invalid_value): Codex and the proxies in front of it resend the whole
    # conversation on it, and match "previous response ... not found" in the message
    body = e.value.body
    assert (body["param"], body["code"]) == ("previous_response_id", "previous_response_not_found")
    assert f"previous response with id {first.id!r} not found" in body["message"]


def test_responses_input_items_list_and_page(client, server):
    """client.responses.input_items.list: the items the request sent, newest first by default,
    paged by item id (after / before), limit in OpenAI's range [1, 100]."""
    sent = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": "Hello!"},
        {"type": "message", "role": "user", "content": "Name a color."},
    ]
    r = client.responses.create(model="smol", input=sent, max_output_tokens=2, temperature=0)
    items = list(client.responses.input_items.list(r.id, order="asc"))
    assert [(i.type, i.role, i.status) for i in items] == [
        ("message", m["role"], "completed") for m in sent
    ]  # fmt: skip
    assert [i.content[0].text for i in items] == ["Be brief.", "Hi", "Hello!", "Name a color."]
    assert [i.content[0].type for i in items] == ["input_text", "input_text", "output_text", "input_text"]
    ids = [i.id for i in items]
    assert len(set(ids)) == 4
    newest = client.responses.input_items.list(r.id, limit=2)
    assert [i.id for i in newest.data] == ids[::-1][:2] and newest.has_more and newest.last_id == ids[2]
    assert [i.id for i in newest] == ids[::-1]  # the SDK pages on with after=last_id
    page = client.responses.input_items.list(r.id, order="asc", after=ids[0], extra_query={"before": ids[3]})
    assert [i.id for i in page.data] == ids[1:3] and not page.has_more
    short = client.responses.create(model="smol", input="Hi", max_output_tokens=1)
    one = client.responses.input_items.list(short.id)
    assert one.data[0].role == "user" and one.data[0].content[0].text == "Hi"
    bad = [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"after": "msg_nope"}, "after"),
           ({"order": "up"}, "order"), ({"include": "everything"}, "include")]  # fmt: skip
    for params, param in bad:
        got = httpx.get(
            f"{server.url}/v1/responses/{r.id}/input_items", params=params, headers=server.headers
        )
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_responses_function_call_round_trip(client):
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [
        {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": city}
    ]
    r = client.responses.create(
        model="smol", input="What is the weather in Paris?", tools=tools, tool_choice="required",
        max_output_tokens=40, temperature=0,
    )  # fmt: skip
    call = next(item for item in r.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    follow = client.responses.create(
        model="smol", previous_response_id=r.id, tools=tools, max_output_tokens=12, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )  # fmt: skip
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens
    # the model calls again, cut by the limit: a call so far or none, never its markup as text
    assert follow.output and "<tool_call>" not in follow.output_text


def test_responses_stream_reassembles_to_the_non_streamed_text(client):
    kw = {"model": "smol", "input": "Name three colors.", "max_output_tokens": 16, "temperature": 0,
          "instructions": "Be brief."}  # fmt: skip
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_logprobs_streamed_and_not(client):
    """top_logprobs (with OpenAI's include flag) gives output_text.logprobs: once always []."""
    kw = {"model": "smol", "input": "Name a color.", "max_output_tokens": 6, "temperature": 0,
          "top_logprobs": 2, "include": ["message.output_text.logprobs"]}  # fmt: skip
    plain = client.responses.create(**kw)
    part = plain.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text == plain.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, part.logprobs))  # two runs
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == len(streamed)


def test_responses_stream_helper_accumulates_what_was_sent(client):
    """client.responses.stream() adds each delta to the item that output_item.added carried,
    so that item must come empty (OpenAI's order), or the helper's text doubles."""
    kw = {"model": "smol", "input": "Say just the word: hello", "max_output_tokens": 16, "temperature": 0}
    with client.responses.stream(**kw) as st:
        events = list(st)
        final = st.get_final_response()
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert final.output_text and snapshots[-1] == final.output_text
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.content == []
    kinds = [e.type for e in events if not e.type.endswith(".delta")]
    assert kinds[2:-1] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "name": "get_weather", "parameters": city}]
    with client.responses.stream(
        model="smol", input="What is the weather in Paris?", tools=tools, tool_choice="required",
        max_output_tokens=40, temperature=0,
    ) as st:  # fmt: skip
        events = list(st)
        final = st.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    snapshots = [e.snapshot for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(snapshots) > 1 and snapshots[-1] == call.arguments and "city" in json.loads(call.arguments)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.arguments == ""


def test_responses_stream_ends_each_call_before_the_next_begins(client):
    """OpenAI's order: a function call's done events come before the next call is added (all
    came at the end of the stream, so a client could not start the first call's work early)."""
    tools = [
        {"type": "function", "name": "get_weather",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
    ]  # fmt: skip
    events = list(
        client.responses.create(
            model="smol",
            input="Weather in Paris and the time?",
            tools=tools,
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )  # fmt: skip
    )
    final = events[-1].response
    assert len(final.output) >= 2 and all(item.type == "function_call" for item in final.output)
    edges = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    expected = [("response.output_item." + k, i) for i in range(len(final.output)) for k in ("added", "done")]
    assert edges == expected
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.status, d.arguments) for d in done] == [("completed", c.arguments) for c in final.output]
    assert all(isinstance(json.loads(d.arguments), dict) for d in done)


def test_responses_objects_and_events_parse_as_the_sdks_types(server):
    """Typed clients validate what they get: tool_choice was null (the SDK's Response requires
    it; OpenAI's default is "auto"), usage lacked input_tokens_details.cache_write_tokens and
    response.function_call_arguments.done the function's name."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "smol", "input": "hi", "max_output_tokens": 3, "temperature": 0}
    assert Response.model_validate(post(server, "/v1/responses", body).json()).tool_choice == "auto"
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    streamed = {**body, "max_output_tokens": 40, "stream": True, "tools": [tool], "tool_choice": "required",
                "parallel_tool_calls": False}  # fmt: skip
    events = [
        json.loads(x[6:])
        for x in post(server, "/v1/responses", streamed).text.splitlines()
        if x.startswith("data: ")
    ]
    kinds = [TypeAdapter(ResponseStreamEvent).validate_python(e).type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed", kinds
    done = events[-1]["response"]  # completed_at: OpenAI's, set when completed (was absent)
    assert done["completed_at"] >= done["created_at"] and events[0]["response"]["completed_at"] is None


def test_embeddings_batch_order_and_formats(client, server):
    texts = [f"document number {i} about {'cats' if i % 2 else 'ships'}" for i in range(64)]
    batch = client.embeddings.create(model="smol", input=texts)
    assert [d.index for d in batch.data] == list(range(64)) and len(batch.data[0].embedding) == 576
    alone = client.embeddings.create(model="smol", input=texts[5]).data[0].embedding
    in_32 = client.embeddings.create(model="smol", input=texts[:32]).data[5].embedding
    cos = sum(a * b for a, b in zip(alone, in_32))  # both L2-normalized
    assert cos >= 0.9999 and abs(sum(a * a for a in alone) - 1) < 1e-4
    assert abs(sum(a * b for a, b in zip(alone, batch.data[5].embedding)) - 1) < 1e-4
    counts = [len(post(server, "/tokenize", {"prompt": t}).json()["tokens"]) for t in texts]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(counts)
    ids = post(server, "/tokenize", {"prompt": texts[5]}).json()["tokens"]
    by_ids = client.embeddings.create(model="smol", input=[ids]).data[0].embedding
    assert sum(a * b for a, b in zip(alone, by_ids)) >= 0.9999
    b64 = client.embeddings.create(model="smol", input=texts[5], encoding_format="base64").data[0].embedding
    decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    assert np.allclose(decoded, alone, atol=1e-6)
    r = post(server, "/v1/embeddings", {"input": "x", "dimensions": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_streamed_logprobs_cover_only_the_content(client):
    kw = {"model": "smol", "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 24,
          "temperature": 0, "logprobs": True}  # fmt: skip
    plain = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]  # fmt: skip
    assert streamed == [e.token for e in plain.logprobs.content]
    if plain.finish_reason == "stop":
        assert "<|im_end|>" not in streamed


def test_a_large_body_is_parsed_while_other_requests_are_answered(server):
    """FastAPI parsed and validated a body on the event loop: 300,000 messages (13 MB) held
    every other request and stream for seconds, the whole of the parse. They are parsed in a
    thread now (test_body_parsing.py), where more messages than the context has tokens are
    counted and refused unvalidated: the decode's hold on the GIL is all that is left of it (a
    generous deadline: 10 s and more of validation and rendering before, 0.4 s now)."""
    messages = [{"role": "user", "content": "hello there"}] * 300_000 + [{"role": "nobody"}]
    body = json.dumps({"model": "smol", "messages": messages}).encode()
    headers = {**server.headers, "content-type": "application/json"}
    latencies: list[float] = []

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(timeout=180) as c:
            done = asyncio.Event()

            async def probe() -> None:
                while not done.is_set():
                    t = time.monotonic()
                    assert (await c.get(f"{server.url}/health")).status_code == 200
                    latencies.append(time.monotonic() - t)
                    await asyncio.sleep(0.01)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.2)
            t = time.monotonic()
            r = await c.post(f"{server.url}/v1/chat/completions", content=body, headers=headers)
            took = time.monotonic() - t
            done.set()
            await prober
            return r, took

    r, took = asyncio.run(run())
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "300001 messages can never fit it" in r.json()["error"]["message"]
    assert took < 5 and max(latencies) < 5, (max(latencies), took)


def test_a_conversation_whose_markup_cannot_fit_is_refused_before_tokenizing(server):
    """8,000 messages of 60 letters: their contents fit the character bound, but the template's
    markup around them renders 700,000 characters, more than 8,192 tokens can ever hold. That
    text was tokenized (for 340,000 messages, 9 s of a core) only to be refused as too long.
    (More messages than 8,192 are refused before rendering: message_count.py.)"""
    messages = [{"role": "user", "content": "a" * 60}] * 8_000
    r = post(server, "/v1/chat/completions", {"model": "smol", "messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "characters can never fit it" in err["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_on_each_route(client, server):
    """vLLM's truncate_prompt_tokens (the engine and the offline LLM honour it) was refused by the
    server as an unknown field. Kept: the prompt's last k tokens, which echo and usage show."""
    text = "one two three four five six seven eight nine ten"
    last = post(server, "/tokenize", {"prompt": text}).json()["tokens"][-3:]
    greedy = {"max_tokens": 2, "temperature": 0, "echo": True}
    cut = post(server, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 3, **greedy}).json()
    alone = post(server, "/v1/completions", {"prompt": last, **greedy}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == alone["choices"][0]["text"]
    emb = client.embeddings.create(model="smol", input=text, extra_body={"truncate_prompt_tokens": 3})
    ref = client.embeddings.create(model="smol", input=[last]).data[0].embedding
    assert emb.usage.prompt_tokens == 3 and sum(a * b for a, b in zip(emb.data[0].embedding, ref)) >= 0.9999
    chat = client.chat.completions.create(
        model="smol", messages=HI, max_tokens=1, extra_body={"truncate_prompt_tokens": 4}
    )
    assert chat.usage.prompt_tokens == 4
    whole = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": -1})
    count = len(post(server, "/tokenize", {"prompt": text}).json()["tokens"])
    assert whole.json()["usage"]["prompt_tokens"] == count
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/embeddings", {"input": text}),
    ):
        for bad in (0, -2, 10**6):
            r = post(server, path, {**body, "truncate_prompt_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_tokenize_returns_token_strings_when_asked_as_vllm(server):
    """vLLM's /tokenize takes return_token_strs (text or messages) and answers token_strs, the
    vocabulary's string of each id; it was a 400 "Extra inputs are not permitted"."""
    plain = post(server, "/tokenize", {"prompt": "hello world"}).json()
    assert "token_strs" not in plain
    r = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == plain["tokens"] and r["token_strs"] == ["hello", "Ġworld"]
    chat = post(server, "/tokenize", {"messages": HI, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"] and "<|im_start|>" in chat["token_strs"]


WEATHER_TOOL = {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}
ANSWERED_CALL = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_w", "arguments": '{"c":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip


def test_a_tool_call_cut_by_max_tokens_is_a_partial_call_not_markup(client):
    """tool_choice auto, greedy: the model calls get_w again, and max_tokens cuts the call. Its
    raw markup ('<tool_call>\\n{"name": "get_w", "arguments": {"c": "') was the reply's content;
    now it is the call so far, as forced modes and OpenAI give it (finish_reason "length"), or
    nothing when cut inside its name (after the name, arguments ""). Streamed and not alike; the Responses API
    marks the call incomplete."""
    tools = [{"type": "function", "function": {"name": "get_w", "parameters": WEATHER_TOOL}}]
    kw = {"model": "smol", "messages": ANSWERED_CALL, "tools": tools, "temperature": 0}
    for max_tokens, has_call in ((12, False), (21, True)):
        m = client.chat.completions.create(**kw, max_tokens=max_tokens).choices[0]
        assert m.finish_reason == "length" and "<tool_call>" not in (m.message.content or ""), m
        calls = [(t.function.name, t.function.arguments) for t in m.message.tool_calls or []]
        assert [name for name, _ in calls] == (["get_w"] if has_call else []), calls
        assert all(args.startswith('{"c"') for _, args in calls), calls
        content, streamed = "", {}
        for chunk in client.chat.completions.create(**kw, max_tokens=max_tokens, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    got = streamed.setdefault(tc.index, ["", ""])
                    got[0] += tc.function.name or ""
                    got[1] += tc.function.arguments or ""
        assert content == (m.message.content or "") and [tuple(v) for v in streamed.values()] == calls
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_w", "arguments": '{"c":"Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]  # fmt: skip
    r = client.responses.create(
        model="smol", input=items, max_output_tokens=21, temperature=0,
        tools=[{"type": "function", "name": "get_w", "parameters": WEATHER_TOOL}],
    )  # fmt: skip
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [
        ("function_call", "incomplete")
    ]


@pytest.mark.parametrize("part", [{"type": "input_text"}, {"type": "input_text", "text": 5}])
def test_a_responses_text_part_without_text_is_refused(server, part):
    """A part without its text was read as an empty one (200): OpenAI's 400, and chat's."""
    body = {"input": [{"role": "user", "content": [part]}], "max_output_tokens": 2}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "input_text part that needs text" in r.json()["error"]["message"], r.text


def test_a_compressed_body_is_refused_saying_so(server):
    """A gzip body (Content-Encoding: gzip) was answered 400 "not valid JSON (not UTF-8: byte
    0x8b at offset 1)"; the server does not decode it, and now says that, with a 415."""
    body = gzip.compress(json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    headers = {**server.headers, "content-type": "application/json", "content-encoding": "gzip"}
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 415 and "Content-Encoding: gzip" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "unsupported_content_encoding"
    plain = {**headers, "content-encoding": "identity"}
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=plain)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("item", ["hi", 5, ["hi"]])
def test_a_responses_input_item_that_is_no_object_is_named(server, item):
    """A list holding a string was refused as "input: Input should be a valid string", which
    a list's sender cannot act on; the error names the item."""
    r = post(
        server, "/v1/responses", {"input": [{"role": "user", "content": "a"}, item], "max_output_tokens": 2}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert r.json()["error"]["message"] == "input: item 1 must be an object", r.text
