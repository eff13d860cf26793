"""Scaling signals, graceful degradation and the response cache against real `kvserve serve`
replicas and a real Redis (the gateway's state store, so the cache lives there).

The primary runs with --max-num-seqs 1, so one long stream fills it and the next request
waits: saturation is then max(KV, 1/1) + 1/1 = 2, with that request's prompt as waiting
prefill tokens. Through the gateway, the saturated "big" sends half its requests to "small"
(x-kvserve-degraded: fallback), and "big-shed" refuses priority >= 1 with 503 + Retry-After.
"small" caches greedy answers exactly; "small-sem" also semantically, where negation pairs
must never hit although their embeddings are close.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import time

import httpx
import pytest
from gateway_utils import GatewayProcess, RedisServer
from server_utils import ServerProcess

KEY = "sk-degrade"
AUTH = {"Authorization": f"Bearer {KEY}"}
TTL, THRESHOLD = 300, 0.9
QUEUED = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]


@pytest.fixture(scope="module")
def servers(tiny_long_dir, tiny_llama_dir):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        big = pool.submit(ServerProcess, tiny_long_dir, "--max-num-seqs", "1", "--kv-cache-memory", "64MiB",
                          "--served-model-name", "big")  # fmt: skip
        small = pool.submit(ServerProcess, tiny_llama_dir, "--kv-cache-memory", "16MiB",
                            "--served-model-name", "small")  # fmt: skip
        servers = big.result(), small.result()
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def gw(servers, redis_server, tmp_path_factory):
    big, small = servers
    tmp = tmp_path_factory.mktemp("gw-degrade")
    dep = lambda alias, i, s, model: {  # noqa: E731
        "model_name": alias, "id": i,
        "backend": {"base_url": s.url + "/v1", "model": model, "api_key": s.api_key},
    }  # fmt: skip
    cfg = {
        "model_list": [dep("big", "big-0", big, "big"), dep("big-shed", "big-shed-0", big, "big"),
                       dep("small", "small-0", small, "small"),
                       dep("small-sem", "small-sem-0", small, "small")],
        "router_settings": {
            "saturation_poll_interval": 0.2,
            "degradation": {
                "big": {"threshold": 0.9, "action": "fallback", "fallback": "small", "share": 0.5},
                "big-shed": {"threshold": 0.9, "action": "shed", "shed_priority": 1, "retry_after": 7},
            },
        },
        "response_cache": {"ttl": TTL, "models": ["small", "small-sem"],
                           "semantic": {"embedding_model": "small", "models": ["small-sem"],
                                        "threshold": THRESHOLD, "pooling": "mean"}},
        "keys": [{"key": KEY}],
        "general_settings": {"database": str(tmp / "gw.db"), "state": redis_server.url},
    }  # fmt: skip
    g = GatewayProcess(cfg, str(tmp))
    yield g
    g.stop()
    assert "Traceback" not in g.logs(), g.logs()


def _until(pred, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(0.05)


def _gauge(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return None


def _seen(gw: GatewayProcess) -> float | None:
    return _gauge(httpx.get(gw.url + "/metrics").text, "kvserve_gateway_group_saturation", model="big")


@contextlib.contextmanager
def saturated(big: ServerProcess):
    """One long stream running on the primary and one request queued behind it; yields the
    queued request's future. Closing the stream aborts it, and the queued one then runs."""
    body = {"model": "big", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(timeout=120) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with client.stream("POST", big.url + "/v1/chat/completions", json=body, headers=big.headers) as long:
            lines = long.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the long request is running: it holds the only seat
            queued = pool.submit(
                httpx.post, big.url + "/v1/chat/completions", headers=big.headers, timeout=120,
                json={"model": "big", "messages": QUEUED, "max_tokens": 2},
            )  # fmt: skip
            _until(lambda: big.metrics()["kvserve:num_requests_waiting"] >= 1, what="a waiting request")
            yield queued
        assert queued.result().status_code == 200


def test_manifest_probes_answer_on_live_apps(servers, gw):
    """deploy/k8s's probe paths, requested on a real replica and a real gateway."""
    import yaml

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "k8s")
    for name, url in (("kvserve", servers[0].url), ("kvserve-gateway", gw.url)):
        with open(os.path.join(root, name, "deployment.yaml")) as f:
            c = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            r = httpx.get(url + c[probe]["httpGet"]["path"], timeout=10)
            assert r.status_code == 200, (name, probe, r.text)


def test_saturation_and_waiting_prefill_tokens(servers):
    big, _ = servers
    assert big.metrics()["kvserve:saturation"] == 0.0
    count = httpx.post(big.url + "/tokenize", json={"messages": QUEUED}, headers=big.headers).json()["count"]
    with saturated(big):
        m = big.metrics()
        assert m["kvserve:num_requests_running"] == 1 and m["kvserve:num_requests_waiting"] == 1
        assert 0 < m["kvserve:kv_cache_usage_perc"] < 1
        assert m["kvserve:saturation"] == pytest.approx(2.0)  # max(kv, 1/1) + 1/1 waiting
        assert m["kvserve:num_waiting_prefill_tokens"] == count
    _until(lambda: big.metrics()["kvserve:saturation"] == 0.0, what="saturation back to 0")
    assert big.metrics()["kvserve:num_waiting_prefill_tokens"] == 0


def test_saturated_group_falls_back_and_sheds(servers, gw):
    big, small = servers
    before_small = small.metrics().get("kvserve:request_success_total", 0)
    chat = lambda model, **kw: httpx.post(  # noqa: E731
        gw.url + "/v1/chat/completions", headers=AUTH, timeout=120,
        json={"model": model, "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2,
              "temperature": 0, **kw},
    )  # fmt: skip
    idle = chat("big")  # not saturated: served by big, nothing says degraded
    assert idle.status_code == 200 and idle.headers["x-kvserve-model-group"] == "big"
    assert "x-kvserve-degraded" not in idle.headers
    with saturated(big), concurrent.futures.ThreadPoolExecutor(5) as pool:
        _until(lambda: (_seen(gw) or 0) >= 0.9, what="the gateway seeing the saturation")
        shed = chat("big-shed", priority=1)
        assert shed.status_code == 503, shed.text
        assert shed.headers["retry-after"] == "7" and shed.headers["x-kvserve-degraded"] == "shed"
        assert shed.json()["error"]["code"] == "overloaded" and "saturated" in shed.json()["error"]["message"]
        kept = pool.submit(chat, "big-shed", priority=0)  # urgent enough: waits for big
        futures = [pool.submit(chat, "big") for _ in range(4)]
        _until(lambda: sum(f.done() for f in futures) >= 2, what="the fallback answers")
        fell_back = [f.result() for f in futures if f.done()]
        # the other three are queued at big (plus the one saturated() queued): decided, not degraded
        _until(lambda: big.metrics()["kvserve:num_requests_waiting"] >= 4, what="requests queued at big")
        assert len([f for f in futures if f.done()]) == 2
    answers = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in answers) and kept.result().status_code == 200
    assert "x-kvserve-degraded" not in kept.result().headers
    degraded = [r for r in answers if r.headers.get("x-kvserve-degraded") == "fallback"]
    assert len(degraded) == 2 and all(r.headers["x-kvserve-model-group"] == "small" for r in degraded)
    assert {id(r) for r in degraded} == {id(r) for r in fell_back}
    normal = [r for r in answers if r not in degraded]
    assert all(r.headers["x-kvserve-model-group"] == "big" for r in normal)
    assert small.metrics()["kvserve:request_success_total"] == before_small + 2
    text = httpx.get(gw.url + "/metrics").text
    assert _gauge(text, "kvserve_gateway_degraded_total", model="big", action="fallback") == 2
    assert _gauge(text, "kvserve_gateway_degraded_total", model="big-shed", action="shed") == 1


def _chat(gw, model: str, content, headers: dict | None = None, **kw) -> httpx.Response:
    msgs = content if isinstance(content, list) else [{"role": "user", "content": content}]
    body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})}, timeout=60
    )


def _served(small: ServerProcess) -> float:
    return small.metrics().get("kvserve:request_success_total", 0)


def _attempts(gw) -> float:
    text = httpx.get(gw.url + "/metrics").text
    return _gauge(text, "kvserve_gateway_attempts_total", deployment="small-0", outcome="ok") or 0


def test_repeated_greedy_request_is_answered_from_the_cache(servers, gw, redis_server):
    _, small = servers
    first = _chat(gw, "small", "The quick brown fox")
    assert first.status_code == 200 and first.headers["x-kvserve-cache"] == "miss"
    served, attempts = _served(small), _attempts(gw)
    again = _chat(gw, "small", "The quick brown fox")
    assert again.status_code == 200 and again.headers["x-kvserve-cache"] == "hit", again.headers
    assert again.headers["x-kvserve-cache-match"] == "exact" and again.json() == first.json()
    assert _served(small) == served  # no backend call
    keys = redis_server.client.keys("kvgw:rc:*")
    assert len(keys) == 1 and 0 < redis_server.client.pttl(keys[0]) <= TTL * 1000  # in Redis, with its TTL
    text = httpx.get(gw.url + "/metrics").text
    assert _gauge(text, "kvserve_gateway_cache_total", model="small", result="exact") == 1
    assert _attempts(gw) == attempts  # the hit was no upstream attempt
    # a different sampling parameter, a sampled request, a stream, a no-cache request: all go upstream
    assert _chat(gw, "small", "The quick brown fox", max_tokens=5).headers["x-kvserve-cache"] == "miss"
    for r in (_chat(gw, "small", "The quick brown fox", temperature=0.7),
              _chat(gw, "small", "The quick brown fox", headers={"cache-control": "no-cache"})):  # fmt: skip
        assert r.status_code == 200 and "x-kvserve-cache" not in r.headers
    assert _served(small) == served + 3


NEGATIONS = [
    ("Is it safe to swim in the lake?", "Is it not safe to swim in the lake?"),
    ("Should I take the pills with food?", "Should I never take the pills with food?"),
    ("Can I drink the water from this tap?", "Can't I drink the water from this tap?"),
    ("Is there a fee to enter the park?", "Is there no fee to enter the park?"),
    ("Take 2 tablets a day, is that fine?", "Take 20 tablets a day, is that fine?"),
]


def _cosine(small: ServerProcess, a: str, b: str) -> float:
    body = {"model": "small", "input": [f"user: {a}", f"user: {b}"], "pooling": "mean"}
    va, vb = (
        d["embedding"]
        for d in httpx.post(small.url + "/v1/embeddings", json=body, headers=small.headers).json()["data"]
    )
    return sum(x * y for x, y in zip(va, vb))


def test_semantic_mode_never_matches_a_negation(servers, gw):
    _, small = servers
    close = [p for p in NEGATIONS if _cosine(small, *p) >= THRESHOLD]
    assert close, "no pair embeds within the threshold: the guard would not be exercised"
    for asked, negated in NEGATIONS:
        assert _chat(gw, "small-sem", asked).headers["x-kvserve-cache"] == "miss"
        r = _chat(gw, "small-sem", negated)
        assert r.status_code == 200 and r.headers["x-kvserve-cache"] == "miss", (asked, negated)
        assert _chat(gw, "small-sem", negated).headers["x-kvserve-cache-match"] == "exact"
    # a near-identical question (same negations and numbers) does hit, semantically
    near = "Is it safe to swim in the lake ?"
    assert _cosine(small, NEGATIONS[0][0], near) >= THRESHOLD
    r = _chat(gw, "small-sem", near)
    assert r.headers["x-kvserve-cache"] == "hit" and r.headers["x-kvserve-cache-match"] == "semantic"
    # keyed on the whole conversation: the same last question after an exchange is another one
    convo = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": NEGATIONS[0][0]}]  # fmt: skip
    assert _chat(gw, "small-sem", convo).headers["x-kvserve-cache"] == "miss"
