"""Requests that once stopped the server, each against a real `kvserve serve`: the offending
request gets a 4xx naming the field, the server stays healthy, and the others are unaffected."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import re
import socket
import time

import httpx
import openai
import psutil
import pytest
from openai.types.responses import Response, ResponseErrorEvent, ResponseFailedEvent
from server_utils import ServerProcess

MODEL_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny")
LIMITS = ("--max-num-seqs", "8", "--max-waiting-requests", "16")
OK = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = ServerProcess(
        tiny_llama_dir, *MODEL_ARGS, *LIMITS, "--max-request-bytes", str(8 * 2**20),
        "--api-key", "second-key", "--metrics-require-key",
    )  # fmt: skip
    yield s
    s.stop()


def post(s: ServerProcess, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, headers=s.headers, timeout=60, **kw)


def assert_still_serving(s: ServerProcess) -> None:
    assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
    r = post(s, OK)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_k": 9223372036854775808}, "top_k"),  # once overflowed a tensor and killed the core
        ({"top_k": 10**6}, "top_k"),  # larger than the vocabulary
        ({"seed": 1180591620717411303424}, "seed"),
        ({"priority": 2**70}, "priority"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"min_tokens": 2**63}, "min_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {"99999999999999999999": 1}}, "logit_bias"),
        ({"n": 128}, "n"),  # more samples than the 8 seats: could never run
        ({"n": 9}, "n"),
        ({"best_of": 9}, "best_of"),  # was named n, which the request left at 1
        ({"prompt": ["a", "b", "c", "d", "e"], "n": 4}, "n"),  # 20 sequences > 16 waiting seats
        ({"prompt": ["a"] * 17}, "prompt"),  # was named n, which the request left at 1
        ({"prompt": ["a", "b", "c", "d", "e"], "best_of": 4}, "best_of"),  # was named n too
        ({"logprobs": 21}, "logprobs"),
        # beam search: length ** 1e308 overflowed in the core process and ended it (all requests failed)
        ({"use_beam_search": True, "n": 2, "length_penalty": 1e308}, "length_penalty"),
    ],
)
def test_out_of_range_values_are_400(server, extra, param):
    assert_400(post(server, {**OK, **extra}), param)
    assert_still_serving(server)


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty", "min_p"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_are_400(server, field, value):
    body = json.dumps(OK)[:-1] + f', "{field}": {value}}}'
    r = httpx.post(
        f"{server.url}/v1/completions", content=body,
        headers={**server.headers, "content-type": "application/json"},
    )  # fmt: skip
    assert_400(r, field)
    assert "finite" in r.json()["error"]["message"] or "less than" in r.json()["error"]["message"]


def test_huge_seeds_never_leak_waiting_seats(server):
    """16 bad requests used to each hold a waiting seat forever: then every request was 503."""

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            bad = {**OK, "seed": 2**70}
            return await asyncio.gather(
                *(
                    http.post(f"{server.url}/v1/completions", json=bad, headers=server.headers)
                    for _ in range(32)
                )
            )

    assert {r.status_code for r in asyncio.run(scenario())} == {400}
    assert_still_serving(server)
    m = server.metrics()
    assert m["kvserve:num_requests_waiting"] == 0 and m["kvserve:num_requests_running"] == 0


def test_oversized_body_is_413_before_parsing(server):
    big = {"model": "tiny", "prompt": "hello world " * 1_000_000, "max_tokens": 1}  # 12 MB
    t0 = time.monotonic()
    r = post(server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 30  # refused without tokenizing (it took 52 s before)

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(10):
            yield b" " * 2**20

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=server.headers, timeout=60)
    assert r.status_code == 413
    assert_still_serving(server)


def test_long_prompt_refused_before_tokenizing_and_health_stays_fast(server):
    """A 5 MB prompt is rejected by the character cap (no tokenizing); /health keeps answering."""
    body = {"model": "tiny", "prompt": "hello world " * 416_666, "max_tokens": 1}
    latencies: list[float] = []

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(
                http.post(f"{server.url}/v1/completions", json=body, headers=server.headers)
            )
            while not task.done():
                t0 = time.monotonic()
                assert (await http.get(f"{server.url}/health")).status_code == 200
                latencies.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)
            return task.result()

    r = asyncio.run(scenario())
    assert_400(r, "prompt")
    assert "characters" in r.json()["error"]["message"]
    latencies.sort()
    assert latencies[int(0.99 * (len(latencies) - 1))] <= 0.1, latencies[-5:]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 2_000_000}]}
    assert_400(post(server, chat, "/v1/chat/completions"), "messages")
    assert_400(post(server, {"prompt": "hi " * 2_000_000}, "/tokenize"), "prompt")


def test_auth_schemes_and_keys(server):
    for header in ("Bearer test-key", "bearer second-key", "BEARER test-key"):
        r = httpx.post(f"{server.url}/v1/completions", json=OK, headers={"Authorization": header}, timeout=60)
        assert r.status_code == 200, header
    for header in ("Bearer wrong", "Basic test-key", "test-key", "Bearer test-key-and-more", ""):
        r = httpx.post(f"{server.url}/v1/completions", json=OK, headers={"Authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", header
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # --metrics-require-key
    assert httpx.get(f"{server.url}/metrics", headers=server.headers).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"model": "tiny", "prompt": [', "not valid JSON (Expecting value at character 29)"),
        (b"", "the request body is missing"),
        (b"[1, 2]", "the body must be a JSON object"),
        # these three were "There was an error parsing the body", naming no problem
        (b'{"prompt": "\xff"}', "not valid JSON (not UTF-8: byte 0xff at offset 12)"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON (arrays or objects nested too deeply)"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON (a number with too many digits)"),
    ],
)
def test_a_body_that_is_no_json_object_says_so(server, body, message):
    r = httpx.post(
        f"{server.url}/v1/completions", content=body,
        headers={**server.headers, "content-type": "application/json"},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] is None, err  # no offset posing as a field
    assert_still_serving(server)


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_sent_as_another_type_names_the_content_type(server, content_type):
    """`curl -d '{...}'` sends a form's Content-Type: the JSON object it carried was answered
    "the body must be a JSON object"."""
    headers = {**server.headers, **({"content-type": content_type} if content_type else {})}
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(OK).encode(), headers=headers)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and (content_type or "no Content-Type") in message


def test_a_union_field_reports_the_member_the_value_broke(server):
    """stop is a string or a list of at most 32: 33 strings were "Input should be a valid string"."""
    r = post(server, {**OK, "stop": [str(i) for i in range(33)]})
    assert_400(r, "stop")
    assert r.json()["error"]["message"] == "stop: List should have at most 32 items after validation, not 33"
    assert (
        post(server, {**OK, "stop": 5}).json()["error"]["message"] == "stop: Input should be a valid string"
    )


@pytest.mark.parametrize(
    "path, body, message",
    [  # each was "Input should be a valid string", the first member's complaint, whatever was sent
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt: Input should be a valid integer"),
        ("/v1/completions", {"prompt": [[1], 2]}, "prompt: Input should be a valid list"),
        ("/v1/completions", {"prompt": ["a", 1]}, "prompt: Input should be a valid string"),
        ("/v1/completions", {"prompt": 5}, "prompt: Input should be a string, a list of strings, a list of"),
        ("/v1/embeddings", {"input": [1, 2.5]}, "input: Input should be a valid integer"),
    ],
)
def test_a_prompt_is_checked_as_the_kind_its_first_element_says(server, path, body, message):
    r = post(server, {"model": "tiny", **body}, path)
    assert_400(r, next(iter(body)))
    assert r.json()["error"]["message"].startswith(message), r.text


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}, {}]}, "messages[1].role: Field required"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name: Field required",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name: Field required"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage: Input should be"),
        ({"stop": 5}, "stop: Input should be a valid string"),  # a union member (str) is no field
        # each was "tool_choice: Input should be 'none', 'auto' or 'required'", the first member's
        ({"tool_choice": {"type": "function"}}, "tool_choice.function: Field required"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name: Field required"),
        (
            {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "x", "tools": []}}},
            "tool_choice.allowed_tools.mode: Input should be 'auto' or 'required'",
        ),
        (
            {"tool_choice": {"type": "x"}},
            "tool_choice: Input should be 'none', 'auto', 'required', or an object",
        ),
        ({"tool_choice": "bogus"}, "tool_choice: Input should be 'none', 'auto' or 'required'"),
        ({"function_call": {}}, "function_call.name: Field required"),  # was "... 'none' or 'auto'"
        # a forced call's arguments were then '"f"': a call's arguments are an object
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            'tools: the parameters of tools[0] (\'f\') must be a JSON Schema of "type": "object"',
        ),
        (
            {"functions": [{"name": "f"}, {"name": "g", "parameters": {"type": "array"}}]},
            "functions: the parameters of functions[1] ('g') must be",
        ),
    ],
)
def test_a_validation_error_names_the_path_to_the_field(server, extra, message):
    """FastAPI's errors were reported by their top-level field only: "messages: Field required"
    named neither the message nor the field it lacked. The message gives the path; param stays
    the top-level field."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = post(server, body, CHAT)
    assert_400(r, next(iter(extra)))
    assert r.json()["error"]["message"].startswith(message), r.json()


def test_null_for_a_nullable_openai_field_means_its_default(server):
    """OpenAI's reference declares n, stream, the penalties, logprobs, echo (and the Responses
    API's stream, store, parallel_tool_calls, background, the embeddings' encoding_format)
    nullable with a default, and the openai client sends null for an argument given as None:
    each was a 400."""
    nulls = dict.fromkeys(("n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo"))
    r = post(server, {**OK, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    chat_nulls = {**nulls, "parallel_tool_calls": None}
    del chat_nulls["echo"]
    r = post(server, {**chat, **chat_nulls}, "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text  # not a stream
    assert_400(post(server, {**OK, "n": 0}), "n")  # a value still has to be valid
    responses = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0}
    nulls = dict.fromkeys(("stream", "store", "parallel_tool_calls", "background"))
    r = post(server, {**responses, **nulls}, "/v1/responses")
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    r = post(server, {"model": "tiny", "input": "hi", "encoding_format": None}, "/v1/embeddings")
    assert r.status_code == 200 and isinstance(r.json()["data"][0]["embedding"], list), r.text


def test_stream_options_need_stream(server):
    assert_400(post(server, {**OK, "stream_options": {"include_usage": True}}), "stream_options")
    chunks = post(server, {**OK, "stream": True, "stream_options": {"include_usage": True}}).text
    assert '"prompt_tokens"' in chunks and chunks.rstrip().endswith("data: [DONE]")  # the usage chunk


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": "yes"}, "stream"),  # once read as true
        ({"max_tokens": "4"}, "max_tokens"),
        ({"prompt": [True, False]}, "prompt"),  # once token ids 1 and 0
        ({"temperature": "0"}, "temperature"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ],
)
def test_values_of_the_wrong_json_type_are_400_not_coerced(server, extra, param):
    assert_400(post(server, {**OK, **extra}), param)
    assert post(server, {**OK, "temperature": 1, "top_p": 1}).status_code == 200  # an int stands for a float


def test_a_tool_result_needs_its_call_id(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"},
    ]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    r = post(server, body, "/v1/chat/completions")
    assert_400(r, "messages")
    assert "message 2" in r.json()["error"]["message"] and "tool_call_id" in r.json()["error"]["message"]
    messages[2]["tool_call_id"] = "c1"
    assert post(server, body, "/v1/chat/completions").status_code == 200
    # a legacy `function` result has no id but names its function
    messages[1:] = [{"role": "assistant", "function_call": {"name": "w", "arguments": "{}"}},
                    {"role": "function", "content": "sunny"}]  # fmt: skip
    r = post(server, body, "/v1/chat/completions")
    assert_400(r, "messages")
    assert "message 2" in r.json()["error"]["message"] and "name" in r.json()["error"]["message"]
    messages[2]["name"] = "w"
    assert post(server, body, "/v1/chat/completions").status_code == 200


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"structured_outputs": {"json": "{x"}}, "structured_outputs: invalid json schema: the schema"),
        ({"guided_json": '{"type": "number", "minimum": NaN}'}, "guided_json: invalid json schema: the"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "a schema is a JSON object (or true / false), not an"),
        ({"guided_regex": "[z-a]"}, "guided_regex: invalid regex: Invalid character class"),
        # 100,000 values passed, then held the compile lane ~4 minutes: refused at once, naming enum
        (
            {"structured_outputs": {"json": {"enum": list(range(100_000))}}},
            "enum lists and consts hold 100,000",
        ),
        # a 10,000-character pattern passed, then held the compile lane about a minute
        (
            {"structured_outputs": {"json": {"pattern": "^" + "ab" * 5000 + "$"}}},
            "patterns (pattern, patternP",
        ),
    ],
)
def test_a_constraint_given_as_text_is_400_in_the_clients_terms(server, extra, says):
    """A schema string that is no JSON was answered with xgrammar's failed internal assertion,
    which echoed the whole schema back, and a guided_* field's error named structured_outputs."""
    r = post(server, {**OK, **extra})
    assert_400(r, next(iter(extra)))
    message = r.json()["error"]["message"]
    assert says in message and "Check failed" not in message and "JSON string is" not in message


def test_a_tool_call_whose_arguments_are_no_json_says_so(server):
    """The arguments were a string; the error said they "must be a JSON string", then named
    neither the message nor the call ("messages: tool_calls arguments are not valid JSON")."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    r = post(server, {"model": "tiny", "messages": messages, "max_tokens": 2}, "/v1/chat/completions")
    assert_400(r, "messages")
    message = r.json()["error"]["message"]
    assert "not valid JSON" in message and '{"city": "Par' in message
    assert message.startswith("messages: message 1 (assistant) tool_calls[0] arguments"), message


FN = {"name": "w", "arguments": "{}"}
CALL = {"id": "c1", "type": "function", "function": FN}


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "(user) may not have tool_calls"),
        ({"role": "system", "content": "be brief", "tool_calls": [CALL]}, "(system) may not have tool_calls"),
        (
            {"role": "developer", "content": "d", "function_call": FN},
            "may not have function_call",
        ),
        ({"role": "user", "content": "hi", "tool_call_id": "c1"}, "(user) may not have tool_call_id"),
        ({"role": "user"}, "(user) needs content"),
        ({"role": "user", "content": None}, "content is null"),
        ({"role": "assistant"}, "(assistant) needs content"),
        ({"role": "tool", "tool_call_id": "c1"}, "(tool) needs content"),
        ({"role": "user", "content": []}, "empty content list"),
        ({"role": "assistant", "content": "x", "tool_calls": []}, "messages[1].tool_calls takes at least"),
        ({"role": "assistant", "content": None, "tool_calls": []}, "tool_calls takes at least one"),
        ({"role": "user", "content": [{"type": "text"}]}, "content[0] (text) needs text"),
        ({"role": "system", "content": [{"type": "refusal", "refusal": "no"}]}, "system messages take text"),
    ],
)
def test_a_message_missing_or_misusing_a_field_is_400_naming_it(server, message, words):
    """A user message with tool_calls (rendered as calls the user made) or with no content was
    served; OpenAI refuses each, naming the message and the field."""
    messages = [{"role": "user", "content": "hi"}, message]
    r = post(server, {"model": "tiny", "messages": messages, "max_tokens": 2}, CHAT)
    assert_400(r, "messages")
    assert "message 1" in r.json()["error"]["message"] and words in r.json()["error"]["message"]


def test_a_tool_message_must_answer_a_call_before_it(server):
    """A tool result with no call before it, or naming a call that turn did not make, was
    rendered as the result of a call the model never made; OpenAI refuses both."""
    ask, call2 = {"role": "user", "content": "hi"}, {**CALL, "id": "c2"}
    calls = {"role": "assistant", "content": None, "tool_calls": [CALL, call2]}
    for messages, words in [
        ([ask, {"role": "tool", "tool_call_id": "c1", "content": "x"}], "message 1 (tool) answers no call"),
        (
            [ask, calls, {"role": "tool", "tool_call_id": "c1", "content": "x"}, ask,
             {"role": "tool", "tool_call_id": "c2", "content": "y"}],
            "message 4 (tool) answers no call",
        ),
        (
            [ask, calls, {"role": "tool", "tool_call_id": "c9", "content": "x"}],
            "message 2 (tool) has tool_call_id 'c9', which is not among the tool_calls of the assistant "
            "message before it ('c1', 'c2')",
        ),
    ]:  # fmt: skip
        r = post(server, {"model": "tiny", "messages": messages, "max_tokens": 2}, CHAT)
        assert_400(r, "messages")
        assert words in r.json()["error"]["message"], r.json()
    answered = [ask, calls, {"role": "tool", "tool_call_id": "c2", "content": "y"},
                {"role": "tool", "tool_call_id": "c1", "content": "x"}]  # fmt: skip
    assert post(server, {"model": "tiny", "messages": answered, "max_tokens": 2}, CHAT).status_code == 200
    # the Responses API: the item is named, and a call of the previous response is answerable
    output = {"type": "function_call_output", "call_id": "c9", "output": "x"}
    r = post(server, {"model": "tiny", "input": [ask, output], "max_output_tokens": 2}, "/v1/responses")
    assert_400(r, "input")
    assert "item 1 (function_call_output) has call_id 'c9', which no function_call before it has" in r.text


def test_every_message_shape_openai_accepts_is_served(server):
    """What OpenAI's reference (and so its client's typed params) allows still passes: names, text
    parts for every role, an assistant's refusal (field or part), audio id, null content beside
    tool_calls or a function_call, and a legacy function result with null content."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    parts, refused = [{"type": "text", "text": "a"}], {"type": "refusal", "refusal": "no"}
    conversations = [
        [{"role": "system", "content": parts, "name": "s"},
         {"role": "developer", "content": parts, "name": "d"},
         {"role": "user", "content": parts, "name": "b"}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "c1", "content": parts}],
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "refusal": "I can't"},
         {"role": "assistant", "content": [*parts, refused], "audio": {"id": "1"}},
         {"role": "user", "content": "u"}],
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "function_call": FN},
         {"role": "function", "name": "w", "content": None}],
    ]  # fmt: skip
    for messages in conversations:
        assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices


@pytest.mark.parametrize("kwargs", [{"return_assistant_tokens_mask": True}, {"self": 1}, {"tools": []}])
def test_template_call_parameters_in_chat_template_kwargs_are_named(server, kwargs):
    """return_assistant_tokens_mask came back as transformers' own error with param null, and
    `self` as "the chat template rejected them" under messages: neither named the field."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(server, {**body, "chat_template_kwargs": kwargs}, CHAT)
    assert_400(r, "chat_template_kwargs")
    assert next(iter(kwargs)) in r.json()["error"]["message"]
    assert post(server, {**body, "chat_template_kwargs": {"enable_thinking": False}}, CHAT).status_code == 200


def test_an_embedding_may_fill_the_whole_context(server):
    """No token is generated for an embedding, so max_model_len (256 here) tokens fit; one more
    does not, and the error names this endpoint's field, `input`."""
    r = post(server, {"model": "tiny", "input": [[7] * 256, [7] * 3]}, "/v1/embeddings")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 259
    r = post(server, {"model": "tiny", "input": [7] * 257}, "/v1/embeddings")
    assert_400(r, "input")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, {**OK, "prompt": [7] * 256})  # a completion needs room for one more token
    assert_400(r, "prompt")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 300}], "max_tokens": 1}
    r = post(server, chat, "/v1/chat/completions")  # the field a chat request sent (was `prompt`)
    assert_400(r, "messages")
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert_400(post(server, {"model": "tiny", "input": []}, "/v1/embeddings"), "input")
    assert_400(post(server, {"model": "tiny", "input": ["a"] * 17}, "/v1/embeddings"), "input")  # 16 seats
    assert_still_serving(server)


def test_a_limit_set_by_max_completion_tokens_names_that_field(server):
    """max_completion_tokens (OpenAI's name now) past the context was refused naming
    max_tokens, a field the request did not send; the Responses API's max_output_tokens too."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    r = post(server, chat, CHAT)
    assert_400(r, "max_completion_tokens")
    message = r.json()["error"]["message"]
    assert "+ max_completion_tokens (1000) exceed it" in message and "max_tokens" not in message
    assert_400(post(server, {**chat, "max_completion_tokens": None, "max_tokens": 1000}, CHAT), "max_tokens")
    r = post(server, {"model": "tiny", "input": "hi", "max_output_tokens": 1000}, "/v1/responses")
    assert_400(r, "max_output_tokens")
    assert "+ max_output_tokens (1000) exceed it" in r.json()["error"]["message"]


def test_thousands_of_engine_requests_queue_while_the_core_is_busy(tiny_llama_dir):
    """One API request fanning out into 2,048 engine requests while the core reads nothing
    (stopped here; busy with long steps in life): all are queued. The queue to the core once
    held 1,000, and the next send was reported as a dead engine (a 503 for everyone)."""
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS)  # no --max-waiting-requests: no waiting room
    core = psutil.Process(s.engine_core_pid())
    try:
        core.suspend()
        body = {"model": "tiny", "input": [[5, 6, 7 + i % 50] for i in range(2048)]}  # OpenAI's most
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, s, body, "/v1/embeddings")
            time.sleep(3)  # every add_request has been sent (or refused) by now
            core.resume()
            r = pending.result()
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["data"]) == 2048
        assert_still_serving(s)
    finally:
        if core.is_running():
            core.resume()
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_under_a_grammar_are_numbers(server, stream):
    """Tokens the grammar forbids have logprob -inf, which JSON cannot carry: a 400 naming no
    field once (non-streamed), nulls in the stream. They read -9999.0 (as vLLM's)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 10, "stream": stream,
            "structured_outputs": {"choice": ["yes", "no"]}}  # fmt: skip
    r = post(server, body, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        entries = [
            e for ev in events for c in ev["choices"] for e in (c.get("logprobs") or {}).get("content", [])
        ]
    else:
        entries = r.json()["choices"][0]["logprobs"]["content"]
    tops = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert entries and len(tops) == 10 * len(entries)
    assert all(isinstance(v, float) and -9999.0 <= v <= 0 for v in tops), tops
    assert -9999.0 in tops  # the first step allows two tokens at most, not ten


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": [1]}]}]},
            "messages",
        ),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input",
        ),
        ("/v1/responses", {"input": "hi", "instructions": "\ud800"}, "instructions"),  # was "messages"
        ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "hi \udfff there"}]}, "messages"),
        ("/v1/embeddings", {"input": ["fine", "\ud800"]}, "input"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_text_that_is_no_text_is_400_and_the_connection_stays_usable(server, path, body, param):
    """A text part that is not a string and a lone surrogate (valid JSON, no character) were
    500s with a trace in the log, and the keep-alive connection was dropped after them."""
    limit = {"max_tokens": 2} if path in (CHAT, "/v1/completions") else {}
    wire = json.dumps({"model": "tiny", **limit, **body})  # ASCII: the surrogate as \\ud800
    headers = {**server.headers, "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as one_connection:
        r = one_connection.post(path, content=wire)
        assert_400(r, param)
        assert one_connection.post("/v1/completions", json=OK).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_output_tokens": 1000}, "max_output_tokens"),  # past the 256-token context
        ({"input": "word " * 400}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        (
            {"max_tool_calls": 0, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"},
            "max_tool_calls",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools"),
    ],
)
def test_responses_errors_name_the_responses_field(server, body, param):
    """The Responses API runs as a chat request; its errors named the chat fields (max_tokens,
    prompt, response_format), which this request does not have."""
    r = post(server, {"model": "tiny", "input": "hi", "max_output_tokens": 4, **body}, "/v1/responses")
    assert_400(r, param)
    assert "max_tokens" not in r.json()["error"]["message"]


def test_responses_background_only_routes_say_so(server):
    """GET ?stream=true (the SDK's retrieve(stream=True)) was answered JSON, which the SDK read as
    an empty stream; POST .../cancel was a 404 naming the route, as if the id were unknown."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    rid = client.responses.create(model="tiny", input="hi", max_output_tokens=2).id
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.retrieve(rid, stream=True)
    assert e.value.body["param"] == "stream" and "background" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(rid)
    assert e.value.body["param"] == "response_id" and "background" in e.value.body["message"]
    assert client.responses.retrieve(rid).id == rid  # still there, unchanged
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
@pytest.mark.parametrize(
    "metadata",
    [{f"k{i}": "v" for i in range(17)}, {"k": "x" * 513}, {"k" * 65: "v"}],
    ids=["17 pairs", "a 513-character value", "a 65-character key"],
)
def test_metadata_past_openais_limits_is_400(server, path, metadata):
    """OpenAI's rule (16 pairs, keys up to 64 and values up to 512 characters): any size was
    taken, and a response stores metadata and echoes it in every GET."""
    body = (
        {"input": "hi", "max_output_tokens": 2}
        if path != CHAT
        else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert_400(post(server, {"model": "tiny", **body, "metadata": metadata}, path), "metadata")
    most = {f"k{i:063d}": "v" * 512 for i in range(16)}  # at the limits: 64-character keys
    assert post(server, {"model": "tiny", **body, "metadata": most}, path).status_code == 200


OBJECT = {"type": "object"}


@pytest.mark.parametrize(
    "path, body, param, field",
    [
        # OpenAI's pattern for the name, ^[a-zA-Z0-9_-]+$ and at most 64 characters: any was taken
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": OBJECT}}},
         "response_format", "response_format.json_schema.name"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}},
         "response_format", "response_format.json_schema.name"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "café", "schema": OBJECT}}},
         "text", "text.format.name"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "", "schema": OBJECT}}},
         "text", "text.format.name"),
        # OpenAI and vLLM require the name: a missing one was taken as "response"
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": OBJECT}}},
         "response_format", "response_format.json_schema.name: Field required"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": OBJECT}}},
         "text", "text: format.name is required for type json_schema"),
        # a schema sent with another type was dropped unsaid: any JSON object (or text) came back
        (CHAT, {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": OBJECT}}},
         "response_format", "json_schema is only used with type json_schema"),
        ("/v1/responses", {"text": {"format": {"type": "json_object", "schema": OBJECT}}},
         "text", "schema is only used with type json_schema"),
    ],
)  # fmt: skip
def test_a_response_format_openai_would_refuse_is_400(server, path, body, param, field):
    limit = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 2}
    hi = [{"role": "user", "content": "hi"}]
    messages = {"input": "hi"} if path == "/v1/responses" else {"messages": hi}
    r = post(server, {"model": "tiny", **messages, **limit, **body}, path)
    assert_400(r, param)
    assert field in r.json()["error"]["message"], r.text
    fine = {"name": "Answer_v2-" + "x" * 54, "schema": OBJECT}  # 64 characters of the allowed ones
    ok = {"response_format": {"type": "json_schema", "json_schema": fine}} if path == CHAT else {
        "text": {"format": {"type": "json_schema", **fine}}}  # fmt: skip
    assert post(server, {"model": "tiny", **messages, **limit, **ok}, path).status_code == 200


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_two_tools_of_one_name_are_400_naming_the_field(server):
    """Two functions of one name were taken: the model was shown both, and a forced call was
    held to the last one's parameters. OpenAI refuses them naming `tools`; so do chat (and its
    legacy `functions`), the Responses API and /tokenize."""
    city, zip_ = {"type": "object", "properties": {"city": {"type": "string"}}}, {"type": "object"}
    hi, limit = [{"role": "user", "content": "hi"}], {"model": "tiny", "max_tokens": 8, "temperature": 0}
    tools = [_tool("get", city), _tool("other", zip_), _tool("get", zip_)]
    named = {"type": "function", "function": {"name": "get"}}
    for choice in (None, named, "required"):
        r = post(server, {"messages": hi, "tools": tools, "tool_choice": choice, **limit}, CHAT)
        assert_400(r, "tools")
        assert "'get' is declared twice (tools[0] and tools[2])" in r.json()["error"]["message"]
    functions = [t["function"] for t in tools]
    r = post(server, {"messages": hi, "functions": functions, **limit}, CHAT)
    assert_400(r, "functions")
    assert "(functions[0] and functions[2])" in r.json()["error"]["message"]
    flat = [{"type": "function", **t["function"]} for t in tools]
    r = post(server, {"model": "tiny", "input": "hi", "tools": flat, "max_output_tokens": 8}, "/v1/responses")
    assert_400(r, "tools")
    assert_400(post(server, {"model": "tiny", "messages": hi, "tools": tools}, "/tokenize"), "tools")
    # as allowed_tools narrows them: the indexes are the client's, not those left after the cut
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [named]}}
    r = post(server, {"messages": hi, "tools": tools, "tool_choice": allowed, **limit}, CHAT)
    assert "(tools[0] and tools[2])" in r.json()["error"]["message"]
    ok = post(server, {"model": "tiny", "messages": hi, "tools": tools[:2]}, "/tokenize")  # (256-token model)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"prompt": {"id": "pmpt_1", "variables": {"city": "Paris"}}}, "prompt"),
        ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ],
)
def test_responses_server_side_state_is_refused_saying_so(server, body, param):
    """OpenAI's conversations and stored prompt templates need state this server does not
    keep: refused with the reason (were "Extra inputs are not permitted"); prompt is not
    renamed input as the chat path's prompt errors are."""
    r = post(server, {"model": "tiny", "input": "hi", "max_output_tokens": 4, **body}, "/v1/responses")
    assert_400(r, param)
    assert "not supported by this server" in r.json()["error"]["message"]
    if param == "prompt":  # a stored prompt stands for input, so it comes alone: once "input: Field required"
        r = post(server, {"model": "tiny", "max_output_tokens": 4, **body}, "/v1/responses")
        assert_400(r, param)
        assert "not supported by this server" in r.json()["error"]["message"]
        assert_400(post(server, {"model": "tiny"}, "/v1/responses"), "input")


def test_responses_stream_and_cache_options_are_accepted(server):
    """OpenAI's stream_options (include_obfuscation) and prompt-cache settings were refused as
    unknown fields; they are accepted (no obfuscation is sent), stream_options only streaming."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}  # fmt: skip
    opts = {"stream_options": {"include_obfuscation": False}}
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, **opts, "stream": True},
                      headers=server.headers, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        kinds = [json.loads(x[6:])["type"] for x in r.iter_lines() if x.startswith("data: {")]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert_400(post(server, {**body, **opts}, "/v1/responses"), "stream_options")
    assert post(server, body, "/v1/responses").status_code == 200


def test_a_response_echoes_the_sampling_values_it_used(server):
    """temperature and top_p came back null when the request left them out, though the request
    sampled with 1.0 each (OpenAI's defaults, which its response shows); now the values used, in
    the response, its stream's events and the stored copy."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    r = post(server, body, "/v1/responses").json()
    assert (r["temperature"], r["top_p"]) == (1.0, 1.0)
    stored = httpx.get(f"{server.url}/v1/responses/{r['id']}", headers=server.headers).json()
    assert (stored["temperature"], stored["top_p"]) == (1.0, 1.0)
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True},
                      headers=server.headers, timeout=60) as s:  # fmt: skip
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert {(e["response"]["temperature"], e["response"]["top_p"]) for e in events if "response" in e} == {
        (1.0, 1.0)}  # fmt: skip
    r = post(server, {**body, "temperature": 0, "top_p": 0.5}, "/v1/responses").json()
    assert (r["temperature"], r["top_p"]) == (0, 0.5)


def test_a_bad_query_parameter_is_named(server):
    r = httpx.get(f"{server.url}/v1/batches", params={"limit": "abc"}, headers=server.headers)
    assert_400(r, "limit")  # once param "query"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_an_unknown_service_tier_is_400_naming_it(server, path):
    """Any string was accepted as service_tier (a typo such as "prioritty" served silently);
    OpenAI refuses a tier outside auto / default / flex / scale / priority with a 400."""
    body = {"max_tokens": 2} if path == "/v1/chat/completions" else {"max_output_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"input": "hi"}
    r = post(server, {**body, "service_tier": "turbo"}, path)
    assert_400(r, "service_tier")
    assert "priority" in r.json()["error"]["message"]  # the accepted values are listed
    for tier in ("auto", "default", "flex", "scale", "priority"):
        r = post(server, {**body, "service_tier": tier}, path)
        assert r.status_code == 200 and r.json()["service_tier"] == "default", r.text


def test_reasoning_efforts_openai_takes_are_served_and_a_typo_is_400(server):
    """reasoning_effort "xhigh" (OpenAI's since GPT-5.2; Codex sends it) was a 400, and the
    Responses API's `reasoning` took any effort at all ("turbo" served); both now take OpenAI's
    values and refuse another, naming the field."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for effort in ("xhigh", "max", "minimal"):
        r = post(server, {**chat, "reasoning_effort": effort}, CHAT)
        assert r.status_code == 200, r.text
        body = {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": effort}}
        r = post(server, body, "/v1/responses")
        assert r.status_code == 200, r.text
    assert_400(post(server, {**chat, "reasoning_effort": "turbo"}, CHAT), "reasoning_effort")
    for bad in ({"effort": "turbo"}, {"summary": "verbose"}):
        r = post(server, {"input": "hi", "max_output_tokens": 2, "reasoning": bad}, "/v1/responses")
        assert_400(r, "reasoning")
        assert f"reasoning.{next(iter(bad))}" in r.json()["error"]["message"], r.text


def test_unknown_routes_and_methods_have_string_codes(server):
    """error.code is a string everywhere (these two once carried the status, an int)."""
    r = httpx.get(f"{server.url}/v1/nothing-here", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/completions", headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST", r.headers  # RFC 9110: a 405 names the methods (was none)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input", "needs name"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "needs call_id"),
        (
            {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}]},
            "input",
            "item 0 (function_call) arguments must be a string",
        ),  # fmt: skip
        ({"input": [{"type": "message", "role": "user"}]}, "input", "item 0 (message) needs content"),
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input", "needs output"),
        ({"input": "hi", "tools": [{"type": "function", "name": "no spaces"}]}, "tools", "pattern"),
        ({"input": "hi", "include": ["bogus"]}, "include", "'message.output_text.logprobs'"),  # was taken
        (
            {"input": "hi", "tool_choice": {"type": "function"}},
            "tool_choice",
            "tool_choice.name: Field required",
        ),
        ({"input": "hi", "tool_choice": {"name": "f"}}, "tool_choice", "tool_choice.type: Field required"),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "not json"},
                ]
            },
            "input",
            "input: item 1 (function_call) arguments are not valid JSON: 'not json'",
        ),
        (  # OpenAI's 400; it was taken, the call reaching the model as one that never returned
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                ]
            },
            "input",
            "No tool output found for function call 'c1'",
        ),
    ],
)
def test_responses_items_missing_their_fields_say_which(server, body, param, words):
    """Once a pydantic dump of an internal model, with param null."""
    r = post(server, {"model": "tiny", **body}, "/v1/responses")
    assert_400(r, param)
    assert words in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]


def test_a_function_call_output_given_as_parts_is_read_as_their_text(server):
    """OpenAI's function_call_output takes its output as a string or as a list of input_text
    parts; the list reached the model as its JSON dump, type keys and all. The parts' texts are
    joined by newlines, as vLLM joins a message's text parts."""

    def input_tokens(output) -> int:
        call = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
        items = [{"role": "user", "content": "weather?"}, call,
                 {"type": "function_call_output", "call_id": "c1", "output": output}]  # fmt: skip
        r = post(server, {"model": "tiny", "input": items, "max_output_tokens": 1}, "/v1/responses")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    parts = [{"type": "input_text", "text": "sunny, "}, {"type": "input_text", "text": "21 C"}]
    assert input_tokens(parts) == input_tokens("sunny, \n21 C")


def test_an_item_reference_stands_for_the_stored_item_it_names(server):
    """OpenAI's item_reference (type optional: an item of an id alone) names an input or output
    item of a stored response; it was refused as "item type 'item_reference' is not supported"."""
    hi = {"role": "user", "content": "hi"}

    def sent(items: list[dict]) -> httpx.Response:
        return post(server, {"model": "tiny", "input": items, "max_output_tokens": 2, "temperature": 0},
                    "/v1/responses")  # fmt: skip

    first = sent([hi]).json()
    asked = httpx.get(f"{server.url}/v1/responses/{first['id']}/input_items", headers=server.headers)
    (said,), (answer,) = asked.json()["data"], first["output"]
    whole = sent([hi, answer, hi])
    by_id = sent([{"type": "item_reference", "id": said["id"]}, {"id": answer["id"]}, hi])
    assert by_id.status_code == 200, by_id.text
    assert by_id.json()["usage"]["input_tokens"] == whole.json()["usage"]["input_tokens"]
    missing = sent([{"type": "item_reference", "id": "msg_nope"}, hi])
    assert_400(missing, "input")
    said_why = "names 'msg_nope', which no response stored on this server holds (never stored, or expired;"
    assert f"item 0 (item_reference) {said_why}" in missing.text
    # behind a front, the server asked may not be the one storing it: the message says what to do
    assert "they route by previous_response_id, not by item id" in missing.text


def test_an_item_given_twice_is_refused_as_openai_does(server):
    """An item passed back while previous_response_id already carries it reached the model
    twice (its turn repeated in the prompt, unsaid); OpenAI's 400 names the duplicate id."""
    hi = {"role": "user", "content": "hi"}
    body = {"model": "tiny", "max_output_tokens": 2, "temperature": 0}
    first = post(server, {**body, "input": [hi]}, "/v1/responses").json()
    answer, on = first["output"][0], {**body, "previous_response_id": first["id"]}
    again = post(server, {**on, "input": [answer, hi]}, "/v1/responses")
    assert_400(again, "input")
    assert f"item 0: Duplicate item found with id {answer['id']!r}" in again.text
    assert "the items previous_response_id carries" in again.text
    twice = [{"type": "item_reference", "id": answer["id"]}] * 2
    assert "item 1: Duplicate item found" in post(server, {**body, "input": twice}, "/v1/responses").text
    second = post(server, {**on, "input": [hi]}, "/v1/responses")
    assert second.is_success
    # an item of a turn before the previous one is carried too (only the previous response's
    # were checked, so the first answer passed back reached the model twice)
    later = {**body, "previous_response_id": second.json()["id"]}
    for item in (answer, {"type": "item_reference", "id": answer["id"]}):
        twice_back = post(server, {**later, "input": [hi, item]}, "/v1/responses")
        assert_400(twice_back, "input")
        assert f"item 1: Duplicate item found with id {answer['id']!r}" in twice_back.text


def test_an_assistant_refusal_part_passed_back_is_read_as_its_text(server):
    """OpenAI's output message may hold a refusal part; such a history passed back (from OpenAI,
    or a gateway's fallback) was refused as "content part type 'refusal' is not supported"."""

    def sent(part: dict, role: str = "assistant") -> httpx.Response:
        items = [
            {"role": "user", "content": "hi"},
            {"role": role, "content": [part]},
            {"role": "user", "content": "ok"},
        ]
        return post(server, {"model": "tiny", "input": items, "max_output_tokens": 1}, "/v1/responses")

    refused = sent({"type": "refusal", "refusal": "I can't help with that."})
    assert refused.status_code == 200, refused.text
    said = sent({"type": "output_text", "text": "I can't help with that."}).json()
    assert refused.json()["usage"]["input_tokens"] == said["usage"]["input_tokens"]
    assert "needs refusal, a string (got missing)" in sent({"type": "refusal"}).text
    assert "part type 'refusal' is not supported" in sent({"type": "refusal", "refusal": "no"}, "user").text


def test_a_reasoning_item_passed_back_is_taken_and_left_out(server):
    """A reasoning model's turn passed back whole (its reasoning item first, as the SDK's
    output_as_input gives it) was refused as "item type 'reasoning' is not supported"; OpenAI
    takes it, and this model, reasoning none, leaves it out of the prompt."""
    hi = {"role": "user", "content": "hi"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a greeting"}]}
    said = {"role": "assistant", "content": "hello"}

    def sent(items: list[dict]) -> dict:
        r = post(server, {"model": "tiny", "input": items, "max_output_tokens": 1}, "/v1/responses")
        assert r.status_code == 200, r.text
        return r.json()

    r = sent([hi, thought, said, hi])
    assert r["usage"]["input_tokens"] == sent([hi, said, hi])["usage"]["input_tokens"]
    listed = httpx.get(f"{server.url}/v1/responses/{r['id']}/input_items?order=asc", headers=server.headers)
    assert [i["type"] for i in listed.json()["data"]] == ["message", "reasoning", "message", "message"]


def test_text_parts_reach_the_model_joined_by_newlines(server):
    """A message's text parts are joined by newlines, as vLLM's server and LLM.chat join them
    (they were joined with "", so ["Hello.", "Bye."] read "Hello.Bye."), in chat completions
    and the Responses API alike."""

    def tokens(content) -> list[int]:
        r = post(server, {"model": "tiny", "messages": [{"role": "user", "content": content}]}, "/tokenize")
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    parts = [{"type": "text", "text": "Hello."}, {"type": "text", "text": "Bye."}]
    assert tokens(parts) == tokens("Hello.\nBye.") != tokens("Hello.Bye.")
    input_parts = [{"type": "input_text", "text": "Hello."}, {"type": "input_text", "text": "Bye."}]
    body = {"model": "tiny", "input": [{"role": "user", "content": input_parts}], "max_output_tokens": 1}
    r = post(server, body, "/v1/responses")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(tokens("Hello.\nBye."))


def test_an_assistant_refusal_reaches_the_model_as_its_text(server):
    """A reply that refused comes back with content null and the text as `refusal`; sent back
    in the history, the model read an empty turn."""

    def prompt_tokens(assistant: dict) -> int:
        messages = [{"role": "user", "content": "help me"}, {"role": "assistant", **assistant},
                    {"role": "user", "content": "why not?"}]  # fmt: skip
        r = post(server, {"model": "tiny", "messages": messages}, "/tokenize")
        assert r.status_code == 200, r.text
        return r.json()["count"]

    said = "I can't help with that."
    assert prompt_tokens({"content": None, "refusal": said}) == prompt_tokens({"content": said})
    assert prompt_tokens({"content": None, "refusal": said}) > prompt_tokens({"content": ""})


def test_readiness_and_openapi_document(server):
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    doc = httpx.get(f"{server.url}/openapi.json").json()
    responses = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))  # /ping's GET and POST once shared one (a warning per start)


def test_engine_failure_fails_only_that_request(tiny_llama_dir):
    """A step that raises (fault injected into every chat request's sampling) fails those
    requests with a 500 naming the problem; completions running beside them finish."""
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, env={"KVSERVE_FAULT_INJECT_SAMPLING": "chatcmpl-"})
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        long = {**OK, "max_tokens": 64, "ignore_eos": True}

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as http:
                url, h = s.url, s.headers
                calls = [http.post(f"{url}/v1/completions", json=long, headers=h) for _ in range(4)]
                calls += [http.post(f"{url}/v1/chat/completions", json=chat, headers=h) for _ in range(2)]
                stream = http.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}, headers=h)
                resp = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}
                stream_r = http.post(f"{url}/v1/responses", json=resp, headers=h)
                return await asyncio.gather(*calls, stream, stream_r)

        *done, streamed, streamed_r = asyncio.run(scenario())
        assert [r.status_code for r in done] == [200] * 4 + [500] * 2
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in done[:4])
        assert "fault injected" in done[4].json()["error"]["message"]
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        # the Responses API's stream ends as OpenAI's does: a numbered error event, no [DONE]
        # (its {"error": ...} form made the official client raise instead of yielding the event)
        lines = streamed_r.text.splitlines()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        # then response.failed, its response failed with the error (it ended on the error event,
        # the response left in progress, and not stored: GET said it was never stored)
        kinds = ["response.created", "response.in_progress", "error", "response.failed"]
        assert [e["type"] for e in events] == kinds
        assert "event: error" in lines and [e["sequence_number"] for e in events[2:]] == [2, 3]
        assert events[2]["code"] == "engine_error" and "fault injected" in events[2]["message"]
        failed = events[3]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "fault injected" in failed["error"]["message"]
        stored = httpx.get(f"{s.url}/v1/responses/{failed['id']}", headers=s.headers, timeout=10)
        assert stored.status_code == 200 and stored.json() == failed
        ResponseErrorEvent.model_validate(events[2]), ResponseFailedEvent.model_validate(events[3])
        assert_still_serving(s)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def long_server(tiny_long_dir):
    s = ServerProcess(
        tiny_long_dir, "--kv-cache-memory", "256MiB", "--max-model-len", "8192", "--served-model-name",
        "tiny", "--stream-stall-timeout", "1",
    )  # fmt: skip
    yield s
    s.stop()


def test_client_leaving_a_non_streaming_request_aborts_it(long_server):
    s = long_server
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 8000 tokens
        httpx.post(f"{s.url}/v1/completions", json=body, headers=s.headers, timeout=1.0)
    deadline = time.monotonic() + 10
    while s.metrics()["kvserve:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the abandoned request kept decoding"
        time.sleep(0.1)
    assert s.metrics()["kvserve:kv_cache_usage_perc"] == 0


def test_a_responses_stream_the_client_left_is_kept_cancelled(long_server):
    """A client that closes a Responses stream midway (a chat UI's Stop) stops the generation,
    as OpenAI's does; the response was then never stored, so GET and previous_response_id
    said "not found" of the id response.created had given. It is kept "cancelled", with the
    text written so far, and can be continued."""
    s = long_server
    body = {"model": "tiny", "input": "Go", "max_output_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/responses", json=body, headers=s.headers, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 8:  # created, in_progress, the item and its part added, 4 deltas
                break
    rid = events[0]["response"]["id"]
    deadline = time.monotonic() + 30
    while (got := httpx.get(f"{s.url}/v1/responses/{rid}", headers=s.headers, timeout=10)).status_code == 404:
        assert time.monotonic() < deadline, got.text
        time.sleep(0.1)
    kept = got.json()
    assert kept["status"] == "cancelled" and kept["error"] is None, kept
    assert [(o["type"], o["status"]) for o in kept["output"]] == [("message", "incomplete")]
    written = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert kept["output"][0]["content"][0]["text"].startswith(written) and written
    Response.model_validate(kept)
    on = {"model": "tiny", "input": "go on", "previous_response_id": rid, "max_output_tokens": 1}
    assert post(s, on, "/v1/responses").status_code == 200
    while s.metrics()["kvserve:num_requests_running"] > 0:  # and its generation was stopped
        assert time.monotonic() < deadline, "the left stream kept decoding"
        time.sleep(0.1)


def test_a_stored_response_is_found_in_progress_while_it_streams(long_server):
    """GET of a stored response's id was a 404 until its stream ended (it was stored only
    then); OpenAI's answers it in_progress, with its items so far. Its input items list too;
    previous_response_id to it is a 400 saying it is still in progress (not "not found"); a
    DELETE meanwhile keeps it from being stored when the stream ends."""
    s = long_server
    body = {"model": "tiny", "input": "Go", "max_output_tokens": 4000, "temperature": 0, "stream": True}
    url = f"{s.url}/v1/responses"
    with httpx.stream("POST", url, json=body, headers=s.headers, timeout=60) as r:
        lines = r.iter_lines()
        events = [json.loads(x[6:]) for x in itertools.islice(lines, 40) if x.startswith("data: ")][:6]
        rid = events[0]["response"]["id"]
        live = httpx.get(f"{url}/{rid}", headers=s.headers, timeout=10)
        assert live.status_code == 200, live.text
        got = Response.model_validate(live.json())
        assert got.status == "in_progress" and got.output[0].status == "in_progress"
        items = httpx.get(f"{url}/{rid}/input_items", headers=s.headers, timeout=10).json()
        assert [i["content"][0]["text"] for i in items["data"]] == ["Go"]
        on = post(s, {"model": "tiny", "input": "on", "previous_response_id": rid}, "/v1/responses")
        assert_400(on, "previous_response_id")
        assert "still in progress" in on.text
        cancel = httpx.post(f"{url}/{rid}/cancel", headers=s.headers, timeout=10)
        assert_400(cancel, "response_id")  # (not "finished when it was created")
        assert "stream to stop it" in cancel.text
        assert httpx.delete(f"{url}/{rid}", headers=s.headers, timeout=10).json()["deleted"] is True
    deadline = time.monotonic() + 30
    while s.metrics()["kvserve:num_requests_running"] > 0:  # the stream ended (the client left)
        assert time.monotonic() < deadline, "the left stream kept decoding"
        time.sleep(0.1)
    time.sleep(0.5)  # (the stream's ending stores it, after the abort the metric shows)
    assert httpx.get(f"{url}/{rid}", headers=s.headers, timeout=10).status_code == 404


def test_stalled_reader_is_aborted(long_server):
    """A client that never reads its stream: once its buffers are full the send waits, and
    after --stream-stall-timeout the request is aborted and its blocks freed. Loopback holds
    ~3 MB per connection, so the stream is made heavy (8 choices, 20 alternatives per token:
    ~20 KB a step): it stalls after ~150 of the 8 x 4000 tokens asked for."""
    s = long_server
    body = json.dumps(
        {"model": "tiny", "prompt": "Go", "max_tokens": 4000, "ignore_eos": True, "stream": True,
         "logprobs": 20, "n": 8}
    ).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", s.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {s.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)  # ... and never read the answer
    deadline = time.monotonic() + 120
    while s.metrics().get("kvserve:num_requests_running", 0) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    while s.metrics()["kvserve:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the stalled stream was never aborted"
        time.sleep(0.2)
    m = s.metrics()
    assert m["kvserve:kv_cache_usage_perc"] == 0
    assert m["kvserve:generation_tokens_total"] < 8 * 3000  # stopped long before the end
    sock.close()
    assert_still_serving(s)


NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


def test_responses_max_tool_calls_keeps_that_many_calls(long_server):
    """max_tool_calls (once refused as an unknown field) bounds the function calls a response
    holds, streamed or not; 0 leaves the tools out, so the model answers in text."""
    s = long_server
    tools = [{"type": "function", "name": "f", "parameters": NO_ARGS}]
    base = {"model": "tiny", "input": "hi", "tools": tools, "tool_choice": "required",
            "max_output_tokens": 200, "temperature": 1.0}  # fmt: skip

    def calls(body: dict) -> list[dict]:
        r = post(s, body, "/v1/responses")
        assert r.status_code == 200, r.text
        return [o for o in r.json()["output"] if o["type"] == "function_call"]

    # a seed whose forced array holds 3 or more calls (most do with this random model)
    seed = next(seed for seed in range(20) if len(calls({**base, "seed": seed})) >= 3)
    body = {**base, "seed": seed, "max_tool_calls": 2}
    r = post(s, body, "/v1/responses")
    assert r.json()["max_tool_calls"] == 2
    assert [o["type"] for o in r.json()["output"]] == ["function_call"] * 2
    # (timeout: httpx's default, 5 s between two reads, was this test's one flake: a niced test
    # run under load can wait that long for the next event)
    with httpx.stream("POST", f"{s.url}/v1/responses", json={**body, "stream": True}, headers=s.headers,
                      timeout=60) as r:  # fmt: skip
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 2 and events[-1]["type"] == "response.completed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"] * 2
    assert len(calls({**body, "max_tool_calls": 1})) == 1
    r = post(s, {**base, "tool_choice": "auto", "max_tool_calls": 0, "max_output_tokens": 4}, "/v1/responses")
    assert r.status_code == 200 and [o["type"] for o in r.json()["output"]] == ["message"]


def test_responses_item_cut_by_max_output_tokens_is_incomplete_and_not_carried(long_server):
    """The item max_output_tokens cut was "completed" in an "incomplete" response, a call's
    half-written arguments included; continuing that response was then refused as "input:
    tool_calls arguments are not valid JSON", arguments the client never sent."""
    s = long_server
    city = {"type": "string", "minLength": 500}  # 60 tokens end inside it, past the call's name
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "city": city}, "required": ["city"]}}]  # fmt: skip
    cut = {"model": "tiny", "input": "hi", "tools": tools, "tool_choice": "required", "max_output_tokens": 60}
    r = post(s, cut, "/v1/responses").json()
    assert r["status"] == "incomplete" and [(o["type"], o["status"]) for o in r["output"]] == [
        ("function_call", "incomplete")
    ]
    with httpx.stream("POST", f"{s.url}/v1/responses", json={**cut, "stream": True}, headers=s.headers,
                      timeout=60) as sr:  # fmt: skip
        lines = list(sr.iter_lines())
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "data: [DONE]" not in lines  # OpenAI's Responses stream ends at its last event
    done = [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1]["response"]["output"][0]["status"] == "incomplete"
    text = post(
        s, {"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0}, "/v1/responses"
    ).json()
    assert text["status"] == "incomplete" and text["output"][0]["status"] == "incomplete"
    # calls of no arguments, as many as 27 tokens hold (the greedy answer takes 30, written
    # compact): a call cut before its arguments is left out by the parser, so the last one kept is
    # whole, and stays "completed"
    many = {
        **cut,
        "tools": [{"type": "function", "name": "g", "parameters": NO_ARGS}],
        "max_output_tokens": 27,
    }
    r2 = post(s, {**many, "temperature": 0}, "/v1/responses").json()
    assert r2["status"] == "incomplete" and r2["output"], r2
    assert all(o["status"] == "completed" for o in r2["output"]), r2["output"]
    go_on = {"model": "tiny", "previous_response_id": r2["id"], "input": "go on", "max_output_tokens": 1}
    unanswered = post(s, go_on, "/v1/responses")
    assert_400(unanswered, "input")  # OpenAI's 400: the calls it made are answered first
    assert f"No tool output found for function call {r2['output'][0]['call_id']!r}" in unanswered.text
    on = post(s, {"model": "tiny", "previous_response_id": r["id"], "input": "go on", "max_output_tokens": 2},
              "/v1/responses")  # fmt: skip
    assert on.status_code == 200, on.text
    answer = {"type": "function_call_output", "call_id": r["output"][0]["call_id"], "output": "x"}
    bad = post(s, {"model": "tiny", "previous_response_id": r["id"], "input": [answer]}, "/v1/responses")
    assert_400(bad, "input")
    assert "complete in the previous response's output" in bad.json()["error"]["message"]


def test_allowed_tools_restricts_the_calls_to_the_tools_it_names(long_server):
    """OpenAI's allowed_tools tool_choice (chat's nested form, the Responses API's flat one) was
    refused as "tool_choice: Input should be 'none', 'auto' or 'required'"."""
    s = long_server
    tools = [{"type": "function", "function": {"name": n, "parameters": NO_ARGS}} for n in ("a", "b")]
    only_b = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "b"}}]}}  # fmt: skip
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": only_b, "max_tokens": 40, "temperature": 0}  # fmt: skip
    r = post(s, chat, CHAT)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} == {"b"}
    flat = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]}
    body = {"model": "tiny", "input": "hi", "tools": [{"type": "function", **t["function"]} for t in tools],
            "tool_choice": flat, "max_output_tokens": 40, "temperature": 0}  # fmt: skip
    r = post(s, body, "/v1/responses")
    assert r.status_code == 200, r.text
    assert {o["name"] for o in r.json()["output"] if o["type"] == "function_call"} == {"a"}
    assert r.json()["tool_choice"] == flat
    only_b["allowed_tools"]["tools"] = [{"type": "function", "function": {"name": "zz"}}]
    r = post(s, chat, CHAT)
    assert_400(r, "tool_choice")
    assert "allowed_tools names 'zz', which is not among the tools" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--api-key", ""], "api-key: must not be empty"),  # "Authorization: Bearer " then passed
        (["--engine", "naive", "--api-key", "k"], "api-key: --engine naive"),  # served with no key check
        (["--metrics-require-key"], "metrics-require-key: needs --api-key"),  # /metrics stayed open
    ],
)
def test_key_settings_that_would_leave_the_server_open_are_refused(
    args, message, tmp_path, monkeypatch, capsys
):
    from kvserve.entrypoints.cli import main

    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    assert main(["serve", str(tmp_path / "no-such-model"), "--port", "1", *args]) == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "gateway", "pd-proxy"])
def test_a_port_out_of_range_is_refused(command, capsys):
    """uvicorn took --port 70000 and listened on 4464 (70000 mod 65536), logging 70000."""
    from kvserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--port", "70000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --port: must be a port number in 0-65535, got 70000" in err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-waiting-requests", "0", "must be >= 1"),  # every request "could never be admitted"
        ("--request-timeout", "0", "must be > 0"),  # every request timed out at once
        ("--request-timeout", "nan", "must be a finite number"),
        ("--max-request-bytes", "0", "must be >= 1"),  # every body a 413
        ("--stream-stall-timeout", "-1", "must be >= 0"),
        ("--shutdown-timeout", "nan", "must be a finite number"),
        ("--engine-restart-limit", "-1", "must be >= 0"),
        ("--max-upload-size", "0", "must be >= 1"),
        ("--batch-window", "0", "must be >= 1"),
        ("--response-store-size", "-5", "must be >= 1"),
        ("--served-model-name", "", "must be a non-empty name, got ''"),
        ("--served-model-name", "  ", "must be a non-empty name, got '  '"),
        # started 100,000 engine processes and never became ready
        ("--data-parallel-size", "100000", "must be <= {cpus} (one engine process per CPU at most; "
         "this machine has {cpus}), got 100000"),
        ("--data-parallel-size", "0", "must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_serve_settings_that_would_leave_it_useless_are_refused_at_parse(flag, value, message, capsys):
    """These were taken, and the server started only to refuse or time out every request."""
    from kvserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    message = message.format(cpus=os.cpu_count())
    named = rf"argument {re.escape(flag)}(/-\w+)?: "  # (argparse names a short alias too: -dp)
    assert e.value.code == 2 and re.search(named + re.escape(message), capsys.readouterr().err)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-request-bytes", "-5", "must be >= 1, got -5"),  # every body a 413
        ("--max-request-bytes", "0", "must be >= 1, got 0"),
        ("--prefill-timeout", "nan", "must be a finite number"),  # every prefill failed over
        ("--prefill-timeout", "-1", "must be > 0"),
    ],
)
def test_pd_proxy_settings_that_would_leave_it_useless_are_refused_at_parse(flag, value, message, capsys):
    from kvserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["pd-proxy", "--prefill", "http://p", "--decode", "http://d", flag, value])
    assert e.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_responses_truncation_auto_drops_the_oldest_turns(server):
    """truncation "auto" was taken and ignored: a conversation grown past the context got
    context_length_exceeded as with "disabled". Now its oldest turns are dropped (from a user
    message, so no tool output loses its call) until the prompt and max_output_tokens fit."""
    base = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, "input": "alpha beta gamma " * 12}
    prev, turns = None, 0
    while True:  # chain turns until the 256-token context refuses the next one
        r = post(server, {**base, **({"previous_response_id": prev} if prev else {})}, "/v1/responses")
        if r.status_code != 200:
            break
        prev, turns = r.json()["id"], turns + 1
        assert turns < 10, "the conversation never outgrew the context"
    assert turns >= 1 and r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    auto = {**base, "previous_response_id": prev, "truncation": "auto"}
    r = post(server, auto, "/v1/responses")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["truncation"] == "auto" and got["usage"]["input_tokens"] + 4 <= 256, got["usage"]
    r = post(server, {**auto, "previous_response_id": got["id"], "stream": True}, "/v1/responses")
    last = json.loads([x for x in r.text.splitlines() if x.startswith("data: ")][-1][6:])
    assert last["type"] in ("response.completed", "response.incomplete"), last  # stored whole, cut again
    r = post(server, {**base, "input": base["input"] * 20, "truncation": "auto"}, "/v1/responses")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # one turn


@pytest.mark.parametrize("count, last_role", [(300, "user"), (3_000, "nobody")])
def test_more_messages_than_the_context_has_tokens_are_refused_before_any_work(server, count, last_role):
    """Every rendered turn takes a token at least, so 300 turns cannot fit 256 tokens. A big body
    (3,000 turns, past the body parser's 64 KiB) is counted as soon as it is decoded: a malformed
    last message is never validated (a 12 MB body of 340,000 turns took 10 s of validating and
    rendering before, its GC passes stalling every stream, to be refused in the end)."""
    messages = [{"role": "user", "content": "a"}] * (count - 1) + [{"role": last_role, "content": "a"}]
    r = post(server, {"model": "tiny", "messages": messages, "max_tokens": 1}, CHAT)
    assert_400(r, "messages")
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert f"{count} messages can never fit it" in err["message"], err
    r = post(server, {"model": "tiny", "input": messages[:-1], "max_output_tokens": 1}, "/v1/responses")
    assert_400(r, "input")
    assert f"{count - 1} messages can never fit it" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_responses_truncation_auto_keeps_what_fits_of_more_turns_than_the_context(server):
    """truncation "auto" drops the oldest turns: a conversation of more turns than max_model_len
    is still served, from its last turns (none is counted out before truncation)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 200
    body = {"model": "tiny", "input": turns + [{"role": "user", "content": "hi"}], "truncation": "auto",
            "max_output_tokens": 2, "temperature": 0}  # fmt: skip
    r = post(server, body, "/v1/responses")
    assert r.status_code == 200, r.text
    assert 0 < r.json()["usage"]["input_tokens"] <= 254


def _kv_pool_refusal() -> ValueError:
    """The engine's refusal of a request that fits the context but not the KV pool (8 blocks of
    16 under a 256-token context). A server no longer starts with such a pool (`kvserve serve`
    refuses one smaller than a max_model_len sequence, as vLLM), but the offline engine takes it,
    and the server's renaming of the refusal's fields is checked on the engine's own text."""
    from kvserve.engine.processor import InputProcessor, ModelLimits
    from kvserve.sampling_params import SamplingParams

    try:
        InputProcessor(None, ModelLimits(512, 256, 8, 16)).process(
            "r", [5, 6, 7], SamplingParams(max_tokens=200)
        )
    except ValueError as e:
        return e
    raise AssertionError("the request was not refused")


@pytest.mark.parametrize("sent", ["max_output_tokens", "max_completion_tokens"])
def test_a_request_past_the_kv_pool_names_only_the_fields_it_sent(sent):
    """The KV-pool refusal said "lower max_tokens" to a request that sent max_output_tokens (or
    max_completion_tokens): only "max_tokens (" was renamed in the text."""
    from kvserve.entrypoints.openai.responses import _name_responses_fields
    from kvserve.entrypoints.openai.serving import rename_field

    e = _kv_pool_refusal()
    if sent == "max_output_tokens":  # the Responses API
        _name_responses_fields(e)
    else:  # the chat path, for a request that sent max_completion_tokens
        rename_field(e, "max_tokens", "max_completion_tokens", in_text=True)
    message = str(e)
    assert message.startswith(f"{sent}: ") and "KV blocks" in message and f"lower {sent}" in message, message
    for other in {"max_tokens", "max_completion_tokens", "max_output_tokens"} - {sent}:
        assert re.search(rf"\b{other}\b", message) is None, message


def test_min_tokens_past_max_completion_tokens_names_max_completion_tokens(server):
    """It said "min_tokens: must be <= max_tokens (2)" to a request that sent no max_tokens."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
            "min_tokens": 5}  # fmt: skip
    r = post(server, body, CHAT)
    assert_400(r, "min_tokens")
    assert r.json()["error"]["message"] == "min_tokens: must be <= max_completion_tokens (2), got 5"


def test_responses_input_tokens_counts_what_create_would_run(server):
    """The SDK's responses.input_tokens.count (POST /v1/responses/input_tokens) was a 405: the
    path was GET /v1/responses/{id}'s. It counts the prompt a create would run, a continued
    conversation and instructions included, as usage.input_tokens then reports it."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    first = {"model": "tiny", "input": "Hi", "instructions": "Be brief"}
    made = client.responses.create(**first, max_output_tokens=1)
    counted = client.responses.input_tokens.count(**first)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", made.usage.input_tokens)
    on = {"model": "tiny", "input": "more", "previous_response_id": made.id}
    assert client.responses.input_tokens.count(**on).input_tokens == (
        client.responses.create(**on, max_output_tokens=1).usage.input_tokens
    )
    url = "/v1/responses/input_tokens"
    assert_400(post(server, {**on, "max_output_tokens": 5}, url), "max_output_tokens")  # not OpenAI's either
    gone = post(server, {**on, "previous_response_id": "resp_nope"}, url)
    assert_400(gone, "previous_response_id")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_empty_string_input_is_refused_as_openai_does(server, stream):
    """input "" was answered as a turn of nothing (the model talking to itself); OpenAI's minimum
    length refuses it, code empty_string. An empty list is refused too; "x" is served."""
    body = {"model": "tiny", "input": "", "max_output_tokens": 2, "stream": stream}
    r = post(server, body, "/v1/responses")
    assert_400(r, "input")
    assert r.json()["error"]["code"] == "empty_string"
    assert_400(post(server, {**body, "input": []}, "/v1/responses"), "input")
    assert post(server, {**body, "input": "x"}, "/v1/responses").status_code == 200


def test_responses_empty_previous_response_id_is_refused_as_an_empty_string(server):
    """previous_response_id "" was looked up and answered previous_response_not_found."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "previous_response_id": ""}
    r = post(server, body, "/v1/responses")
    assert_400(r, "previous_response_id")
    assert r.json()["error"]["code"] == "empty_string", r.json()
