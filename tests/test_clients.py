"""Issue 23's acceptance as a new user sees it: the real client libraries (`openai`,
LangChain's `ChatOpenAI`, LiteLLM, instructor; pinned in pyproject's test extra) against one
live `kvserve serve` (the session's compat_server). Each test is a path through a client that
raw HTTP in test_openai_compat.py does not take; generations are short to keep it quick."""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import

import httpx
import instructor
import litellm
import numpy as np
import openai
import pytest
from langchain_core.exceptions import ContextOverflowError
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]  # litellm's
MODEL = "smol"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": CITY}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                         "parameters": CITY}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Capital(BaseModel):
    country: str
    capital: str


@tool
def get_weather(city: str) -> str:
    """Weather for a city."""
    return "sunny"


@pytest.fixture(scope="module")
def server(compat_server):
    return compat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def chat_openai(server, **kw) -> ChatOpenAI:
    """ChatOpenAI as a user configures it, with the newer fields it forwards set (issue 23's
    first row: these were 400s)."""
    fields = {"service_tier": "auto", "reasoning_effort": "low", "verbosity": "low", "store": False,
              "max_tokens": 24, **kw}  # fmt: skip
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=server.api_key, temperature=0,
                      max_retries=0, **fields)  # fmt: skip


@pytest.fixture(scope="module")
def lc(server):
    return chat_openai(server)


def _calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """Streamed tool-call deltas reassembled: [(name, arguments)], finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for ch in chunks:
        for c in ch.choices:
            for d in c.delta.tool_calls or []:
                e = calls.setdefault(d.index, ["", ""])
                e[0] += d.function.name or ""
                e[1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return [tuple(v) for _, v in sorted(calls.items())], finish


# ---- openai: what passed before the issue, so none of it regresses ----------------------------
def test_openai_chat_stream_with_usage_n_and_seed(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}
    plain = client.chat.completions.create(**kw, temperature=0)
    chunks = list(client.chat.completions.create(**kw, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    usage = chunks[-1].usage  # (its cached_tokens differ: the first request cached the prompt)
    assert chunks[-1].choices == [] and usage.total_tokens == plain.usage.total_tokens
    a = client.chat.completions.create(**kw, n=2, seed=7, temperature=1.0)
    b = client.chat.completions.create(**kw, n=2, seed=7, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.prompt_tokens == plain.usage.prompt_tokens  # the prompt counted once for n=2


def test_openai_completions_stream_and_logprobs(client):
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**kw, logprobs=2)
    lp = plain.choices[0].logprobs
    assert "".join(lp.tokens) == plain.choices[0].text and all(len(t) <= 2 for t in lp.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say OK."}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)


def test_openai_json_schema_and_parse(client):
    msgs = [{"role": "user", "content": "The capital of France, as JSON."}]
    r = client.chat.completions.parse(model=MODEL, messages=msgs, response_format=Capital, max_tokens=40,
                                      temperature=0)  # fmt: skip
    assert isinstance(r.choices[0].message.parsed, Capital)
    schema = {"name": "capital", "schema": Capital.model_json_schema(), "strict": True}
    raw = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    assert Capital.model_validate_json(raw.choices[0].message.content) == r.choices[0].message.parsed


@pytest.mark.parametrize(
    "choice, parallel",
    [("auto", True), ("required", True), ({"type": "function", "function": {"name": "get_time"}}, False)],
    ids=["auto", "required-parallel", "named"],
)
def test_openai_tools_with_streamed_deltas(client, choice, parallel):
    ask = [{"role": "user", "content": "What are the weather and the local time in Paris?"}]
    kw = {"model": MODEL, "messages": ask, "tools": [WEATHER, TIME], "tool_choice": choice,
          "parallel_tool_calls": parallel, "max_tokens": 60, "temperature": 0}  # fmt: skip
    r = client.chat.completions.create(**kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]
    if choice != "auto":  # a call forced by name ends with "stop", as OpenAI's does
        assert r.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls") and calls
    for name, args in calls:
        assert name in ("get_weather", "get_time") and "city" in json.loads(args)
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["get_time"]
    streamed, finish = _calls(client.chat.completions.create(**kw, stream=True))
    assert streamed == calls and finish == r.finish_reason


def test_openai_auto_json_answer_naming_no_tool_is_content(client):
    """With tools declared, a json_schema answer {"name": "John", ...} is the answer, not a
    call to an undeclared function "John"."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "A JSON person with name and age."}],
          "tools": [TIME], "max_tokens": 40, "temperature": 0, "response_format": schema}  # fmt: skip
    r = client.chat.completions.create(**kw).choices[0]
    assert r.message.tool_calls is None and r.finish_reason != "tool_calls"
    assert isinstance(json.loads(r.message.content)["name"], str)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.message.content
    assert _calls(chunks) == ([], r.finish_reason)


def test_openai_best_of_returns_the_most_likely_samples(client):
    """best_of=k draws the same k samples as n=k (same seed) and returns the one of highest
    cumulative logprob; every sample is billed."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    drawn = client.completions.create(**kw, n=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in drawn.choices]
    best = client.completions.create(**kw, best_of=3)
    (choice,) = best.choices
    assert choice.text == drawn.choices[scores.index(max(scores))].text and choice.logprobs is None
    assert best.usage.completion_tokens == drawn.usage.completion_tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 6,
            "temperature": 1.0, "seed": 5}  # fmt: skip
    all3 = client.chat.completions.create(**chat, n=3, logprobs=True)
    ranked = sorted(all3.choices, key=lambda c: -sum(e.logprob for e in c.logprobs.content))
    top2 = client.chat.completions.create(**chat, n=2, extra_body={"best_of": 3})
    assert [c.message.content for c in top2.choices] == [c.message.content for c in ranked[:2]]


# ---- openai: the table ----------------------------------------------------------------
def test_openai_table_rows(client, server):
    """developer role, assistant prefill, x-request-id, suffix and the vLLM extras, through the SDK."""
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    user = {"role": "user", "content": "Hi"}
    dev = client.chat.completions.create(**kw, messages=[{"role": "developer", "content": "Be terse."}, user])
    sys_ = client.chat.completions.create(**kw, messages=[{"role": "system", "content": "Be terse."}, user])
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens
    assert dev.choices[0].message.content == sys_.choices[0].message.content
    prefill = [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "My name is"}]
    raw = client.chat.completions.with_raw_response.create(
        **kw, messages=prefill, extra_headers={"x-request-id": "sdk-7"},
        extra_body={"echo": True, "prompt_logprobs": 0, "add_generation_prompt": False},
    )  # fmt: skip
    r = raw.parse()
    assert raw.headers["x-request-id"] == "sdk-7" and r.id == "chatcmpl-sdk-7"
    assert r.choices[0].message.content.startswith("My name is")
    assert r.model_extra["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(", suffix="return 1", max_tokens=2)
    assert "fill-in-the-middle" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a forced call replaces the raw-output constraint
        client.chat.completions.create(**kw, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       extra_body={"structured_outputs": {"regex": "a+"}})  # fmt: skip
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, messages=[user], extra_body={"use_beam_searchh": True})
    assert e.value.body["param"] == "use_beam_searchh"  # unknown fields outside both references stay a 400


# ---- LangChain --------------------------------------------------------------------------------
def test_langchain_invoke_stream_structured_output_and_embeddings(server, lc):
    msg = lc.invoke("Name a color.")
    assert isinstance(msg, AIMessage) and msg.content and msg.usage_metadata["output_tokens"] > 0
    streamed = list(lc.stream("Name a color.", stream_usage=True))
    assert "".join(c.content for c in streamed) == msg.content
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in streamed) > 0
    for method in ("json_schema", "function_calling"):
        out = (
            chat_openai(server, max_tokens=40)
            .with_structured_output(Capital, method=method)
            .invoke("The capital of France, as JSON.")
        )
        assert isinstance(out, Capital), method
    # check_embedding_ctx_length=True would fetch tiktoken's files (no network in CI)
    emb = OpenAIEmbeddings(
        model=MODEL, base_url=f"{server.url}/v1", api_key=server.api_key, check_embedding_ctx_length=False
    )
    docs = np.array(emb.embed_documents(["cats", "ships", "cats"]))
    cos = docs @ np.array(emb.embed_query("cats"))  # unit vectors
    assert docs.shape == (3, 576) and cos[0] > 0.9999 and cos[2] > 0.9999 and cos[1] < 0.999


def test_langchain_bind_tools_round_trip(server, lc):
    forced = chat_openai(server, max_tokens=40).bind_tools([get_weather], tool_choice="get_weather")
    ai = forced.invoke([HumanMessage("What is the weather in Paris?")])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and "city" in call["args"]
    chunks = list(forced.stream([HumanMessage("What is the weather in Paris?")]))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    result = ToolMessage("sunny, 21 C", tool_call_id=call["id"])
    follow = lc.bind_tools([get_weather]).invoke([HumanMessage("What is the weather in Paris?"), ai, result])
    assert isinstance(follow, AIMessage)


def test_langchain_responses_api(server):
    lcr = chat_openai(server, use_responses_api=True, max_tokens=16)
    msg = lcr.invoke("Name three colors.")
    assert msg.text and msg.response_metadata["id"].startswith("resp_")
    streamed = list(lcr.stream("Name three colors."))
    assert "".join(c.text for c in streamed) == msg.text
    lcr40 = chat_openai(server, use_responses_api=True, max_tokens=40)
    ai = lcr40.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and "city" in ai.tool_calls[0]["args"]
    structured = lcr40.with_structured_output(Capital).invoke("The capital of France.")
    assert isinstance(structured, Capital)
    # multi-turn the LangChain way: the server keeps the conversation (previous_response_id)
    chained = chat_openai(
        server, use_responses_api=True, use_previous_response_id=True, store=True, max_tokens=8
    )
    first = chained.invoke("My name is Ada.")
    second = chained.invoke([HumanMessage("My name is Ada."), first, HumanMessage("What is my name?")])
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]


# ---- LiteLLM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["openai", "hosted_vllm"])
def test_litellm_prefixes(server, prefix):
    kw = {"model": f"{prefix}/{MODEL}", "api_base": f"{server.url}/v1", "api_key": server.api_key,
          "max_tokens": 8, "temperature": 0, "num_retries": 0}  # fmt: skip
    r = litellm.completion(**kw, messages=[{"role": "user", "content": "Name a fruit."}])
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens > 0
    fruit = [{"role": "user", "content": "Name a fruit."}]
    chunks = list(litellm.completion(**kw, messages=fruit, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    t = litellm.completion(**{**kw, "max_tokens": 40}, messages=ASK, tools=[WEATHER], tool_choice="required")
    (call,) = t.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    choice = litellm.completion(**kw, messages=ASK, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")  # vLLM's old name, through LiteLLM
    e = litellm.embedding(model=kw["model"], api_base=kw["api_base"], api_key=kw["api_key"], input=["a", "b"])
    assert [d["index"] for d in e.data] == [0, 1] and len(e.data[0]["embedding"]) == 576


def test_context_overflow_is_each_librarys_own_error(client, server):
    """A request past max_model_len is a 400 each library recognises as a context overflow
    (what LiteLLM's context_window_fallbacks and LangChain's trimming react to)."""
    too_long = {"model": MODEL, "messages": ASK, "max_tokens": 10**6}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**too_long)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**{**too_long, "model": f"hosted_vllm/{MODEL}"}, api_base=f"{server.url}/v1",
                           api_key=server.api_key, num_retries=0)  # fmt: skip
    with pytest.raises(ContextOverflowError):
        chat_openai(server, max_tokens=10**6).invoke("hi")


# ---- instructor -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode",
    [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS, instructor.Mode.RESPONSES_TOOLS],
    ids=lambda m: m.name,
)
def test_instructor_modes(client, mode):
    inst = instructor.from_openai(client, mode=mode)
    out = inst.chat.completions.create(
        model=MODEL, response_model=Capital, max_retries=0, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "The capital of France."}],
    )  # fmt: skip
    assert isinstance(out, Capital) and out.capital


def test_cors_preflight_for_a_browser_sdk(server):
    """What the openai SDK in a browser (dangerouslyAllowBrowser) sends before each call."""
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}  # fmt: skip
    r = httpx.options(f"{server.url}/v1/responses", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
