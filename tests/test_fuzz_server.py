"""Random bodies against a live server: never a 5xx, /health stays up, nothing leaks.

Two fuzzers: a hypothesis strategy that fills the OpenAPI schema's own field names with
extreme values (huge ints, NaN and infinities, deep nesting, long strings, wrong types), and
Schemathesis driven by /openapi.json (which must document 400, not 422).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import ServerProcess

MODEL_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny")
LIMITS = ("--max-num-seqs", "8", "--max-waiting-requests", "32")
ENDPOINTS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, *LIMITS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fields(server) -> dict[str, list[str]]:
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    return {path: sorted(schemas[name]["properties"]) for path, name in ENDPOINTS.items()}


def nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def extreme_values() -> st.SearchStrategy:
    scalars = st.one_of(
        st.integers(min_value=-(2**80), max_value=2**80),
        st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e-308]),
        st.booleans(),
        st.none(),
        st.text(max_size=50),
        st.sampled_from(["x" * 100_000, "\x00", "hi", "tiny", "<|im_start|>", "🙂" * 1000]),
    )
    nested = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=20)  # fmt: skip
    deep = st.integers(min_value=1, max_value=900).map(nested_lists)  # json.dumps recurses too
    return st.one_of(scalars, nested, deep)


def messages() -> st.SearchStrategy:
    role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "bogus"])
    content = st.one_of(st.text(max_size=30), st.none(), extreme_values())
    return st.lists(st.fixed_dictionaries({"role": role, "content": content}), max_size=3)


@st.composite
def bodies(draw, names: list[str]) -> dict:
    body = {}
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=6)):
        body[name] = draw(extreme_values())
    if draw(st.booleans()):  # often well-formed at the core, so the extremes reach deeper checks
        if "messages" in names:
            body.setdefault("messages", draw(messages()))
        else:
            body.setdefault("prompt", draw(st.one_of(st.text(max_size=20), extreme_values())))
    return body


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals, as sloppy clients send them
    headers = {**server.headers, "content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=120)


def assert_idle(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["kvserve:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_random_bodies_never_5xx(server, fields, path):
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies(fields[path]))
    def check(body):
        r = post(server, path, body)
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["type"], r.text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200

    check()
    assert_idle(server)


def test_deeply_nested_body_is_400(server):
    for path in ENDPOINTS:
        raw = '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
        r = httpx.post(
            f"{server.url}{path}", content=raw, headers={**server.headers, "content-type": "application/json"}
        )
        assert r.status_code == 400, r.text[:300]
    assert_idle(server)


def test_schemathesis_finds_no_server_error(server):
    """Schemathesis against /openapi.json: bounded examples per operation, zero 5xx. Its
    fuzzing phase only: the coverage phase's ~1,300 boundary cases take 5 minutes here."""
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "1",
        "--phases", "fuzzing",
        "--header", f"Authorization: Bearer {server.api_key}", "--request-timeout", "120",
        "--exclude-path", "/reset_prefix_cache",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert_idle(server)
