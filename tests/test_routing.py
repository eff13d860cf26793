"""Routing policies (kvserve/routing), pure and fast: the exact index sees what the engine's
own KV cache manager caches, cache-aware prefers the holder until balance guards say no,
round-robin / least-loaded / session behave, and the gateway accepts the new names."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.core.block_pool import KVEvents, hash_prompt_blocks
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.routing import (
    BlockHashIndex,
    CacheAware,
    RequestInfo,
    TextPrefixIndex,
    make_strategy,
)
from kvserve.sampling_params import SamplingParams


class T:
    def __init__(self, id: str, load: float | None = None) -> None:
        self.id, self.weight = id, 1.0
        if load is not None:
            self.load = load


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(temperature=0, max_tokens=4)
    return Request(rid, tokens, params, max_tokens=4, eos_token_ids=frozenset(), cache_salt=salt)


def test_exact_index_follows_the_engines_cache():
    """Events from a real KVCacheManager: the router's match equals the engine's hit."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.pool.events = KVEvents()
    index = BlockHashIndex(block_size=4)
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    req = _request("a", prompt, salt="s")
    assert kv.allocate_slots(req, len(prompt)) is not None
    kv.free(req)
    index.apply("0", *kv.pool.events.drain())
    again = _request("b", prompt + [7], salt="s")
    engine_hit = len(kv.get_computed_blocks(again)) * 4
    assert engine_hit == 16
    assert index.match(RequestInfo(token_ids=again.prompt_token_ids, cache_salt="s"), ["0", "1"]) == {
        "0": 16,
        "1": 0,
    }
    assert index.match(RequestInfo(token_ids=again.prompt_token_ids, cache_salt="other"), ["0"]) == {"0": 0}
    # Fill the pool with other content: the evictions reach the index.
    other = _request("c", list(range(300, 332)), salt="s")
    assert kv.allocate_slots(other, 32) is not None
    index.apply("0", *kv.pool.events.drain())
    assert index.match(RequestInfo(token_ids=again.prompt_token_ids, cache_salt="s"), ["0"]) == {"0": 0}
    kv.reset_prefix_cache()
    stored, removed, cleared = kv.pool.events.drain()
    assert cleared and not stored
    index.apply("0", stored, removed, cleared)
    assert not index.cached["0"]


def test_events_keep_the_last_change_per_hash():
    ev = KVEvents()
    ev.changes[b"h"] = False
    ev.changes[b"h"] = True  # evicted, then recomputed in the same step: cached
    assert ev.drain() == ([b"h"], [], False)
    assert ev.drain() == ([], [], False)


def test_cache_aware_prefers_the_holder_until_load_outweighs_the_hit():
    index = BlockHashIndex(block_size=4)
    prompt = list(range(40))
    index.apply("0", hash_prompt_blocks(prompt, 4), [], False)
    ca = CacheAware(index, balance_abs_threshold=10_000)
    req = RequestInfo(token_ids=prompt + [1, 2])
    assert ca.choose([T("0", load=20), T("1", load=0)], req).id == "0"
    assert req.cached_tokens == 40
    assert ca.choose([T("0", load=70), T("1", load=0)], RequestInfo(token_ids=prompt + [1])).id == "0"
    assert ca.choose([T("0", load=90), T("1", load=0)], RequestInfo(token_ids=prompt + [1])).id == "1"


def test_cache_aware_spreads_new_prefixes_by_cache_size():
    index = BlockHashIndex(block_size=4)
    index.apply("0", hash_prompt_blocks(list(range(400)), 4), [], False)  # 0 holds a tenant
    ca = CacheAware(index)
    new = RequestInfo(token_ids=list(range(1000, 1100)))  # nobody holds it: ties by cache size
    assert ca.choose([T("0", load=0), T("1", load=0)], new).id == "1"
    assert new.cached_tokens == 0
    other = RequestInfo(token_ids=list(range(2000, 2100)))
    assert ca.choose([T("0", load=0), T("1", load=30)], other).id == "0"  # load first


def test_cache_aware_places_new_prefixes_by_recent_work():
    """A skewed workload: replica 0 serves a hot tenant's steady stream of small hits, so a
    new tenant's cold prefill goes to replica 1 although 1 holds the larger cache and no load
    is queued on either; once the stream is old news (decayed), the cache size decides again."""
    now = [0.0]
    index = BlockHashIndex(block_size=4)
    hot = list(range(400))
    index.apply("0", hash_prompt_blocks(hot, 4), [], False)
    index.apply("1", hash_prompt_blocks(list(range(5000, 6000)), 4), [], False)  # bigger cache
    ca = CacheAware(index, recent_work_tau=10.0, clock=lambda: now[0])
    idle = [T("0", load=0), T("1", load=0)]
    for i in range(20):  # 20 hot requests, each ~40 uncached tokens, all hits on 0
        now[0] += 0.5
        assert ca.choose(idle, RequestInfo(token_ids=hot + list(range(i * 40, i * 40 + 40)))).id == "0"
    assert ca.recent_work("0") > 500 and ca.recent_work("1") == 0
    cold = RequestInfo(token_ids=list(range(10_000, 10_300)))
    assert ca.choose(idle, cold).id == "1"  # size alone (the old rule) would pick 0
    now[0] += 200.0  # both decayed to ~0: the smaller cache wins the tie again
    assert ca.recent_work("0") < 1e-3 and ca.recent_work("1") < 1e-3
    assert ca.choose(idle, RequestInfo(token_ids=list(range(20_000, 20_100)))).id == "0"


def _skewed_run(seed: int, skew: float, **policy: float) -> tuple[float, float]:
    """128 requests at 0.75/s, 8 tenants of 1,010 tokens + 50-token questions, `skew` of them
    on tenant 0; two replicas that drain 900 queued tokens/s, hold 4 tenants each (LRU) and
    report what they store and evict, as engines do. Returns (computed-token ratio, hit rate)."""
    import random

    now = [0.0]
    ca = CacheAware(BlockHashIndex(block_size=16), clock=lambda: now[0], **policy)
    rng = random.Random(seed)
    systems = [[t * 100_000 + i for i in range(1010)] for t in range(8)]
    hashes = [hash_prompt_blocks(s, 16) for s in systems]
    reps = [T("0", load=0), T("1", load=0)]
    held: dict[str, dict[int, None]] = {"0": {}, "1": {}}
    done, hit, total = {"0": 0, "1": 0}, 0, 0
    for _ in range(128):
        dt = rng.expovariate(0.75)
        now[0] += dt
        for r in reps:
            r.load = max(0.0, r.load - 900 * dt)
        tenant = 0 if rng.random() < skew else rng.randrange(8)
        tokens = systems[tenant] + [rng.randrange(10**9) for _ in range(50)]
        r = ca.choose(reps, RequestInfo(token_ids=tokens))
        cached = 1008 if tenant in held[r.id] else 0
        held[r.id].pop(tenant, None)
        held[r.id][tenant] = None
        ca.index.apply(r.id, hashes[tenant], [], False)
        while len(held[r.id]) > 4:
            old = next(iter(held[r.id]))
            del held[r.id][old]
            ca.index.apply(r.id, [], hashes[old], False)
        work = len(tokens) - cached + 16
        r.load += work
        done[r.id] += work
        hit, total = hit + cached, total + len(tokens)
    return max(done.values()) / min(done.values()), hit / total


def test_cache_aware_keeps_a_skewed_workload_balanced():
    """80% of requests on one tenant: its holder's steady stream of small hits is work the
    queue never shows, so the recent-work rules give the tenant a second holder and send cold
    prefills to the other replica; replicas' computed tokens stay within the issue's 1.5x.
    Placement by queued load alone (recent work switched off) is what was measured at 2.39x;
    with uniform tenants the rebalancing costs (almost) no hits."""
    blind = {"recent_work_tau": 1e-9, "recent_abs_threshold": 1e12}
    for seed in range(3):
        assert _skewed_run(seed, 0.8)[0] <= 1.5, seed
        assert _skewed_run(seed, 0.8, **blind)[0] > 1.5, seed
        assert _skewed_run(seed, 0.0)[1] >= _skewed_run(seed, 0.0, **blind)[1] - 0.03, seed


def test_cache_aware_follows_what_it_routed_before_the_replica_reports_it():
    """A tenant's second request, routed while the first is still queued (nothing reported
    yet), goes where the first went instead of being spread as a new prefix; the pending
    blocks become reported ones, and without a report they expire."""
    index = BlockHashIndex(block_size=4, pending_ttl=60)
    ca = CacheAware(index)
    system = list(range(100, 180))
    targets = [T("0", load=0), T("1", load=0)]
    first = ca.choose(targets, RequestInfo(token_ids=system + [1, 2, 3]))
    targets = [T("0", load=0 if first.id == "1" else 83), T("1", load=83 if first.id == "1" else 0)]
    second = RequestInfo(token_ids=system + [4, 5, 6])
    assert ca.choose(targets, second).id == first.id and second.cached_tokens == 80
    index.apply(first.id, hash_prompt_blocks(system, 4), [], False)  # reported: no longer pending
    assert not index.pending[first.id].keys() & set(hash_prompt_blocks(system, 4))
    stale = BlockHashIndex(block_size=4, pending_ttl=0)
    stale.routed("0", RequestInfo(token_ids=system + [1]))
    assert stale.match(RequestInfo(token_ids=system + [2]), ["0"]) == {"0": 0}


def test_cache_aware_balance_guard():
    index = BlockHashIndex(block_size=4)
    prompt = list(range(400))
    index.apply("0", hash_prompt_blocks(prompt, 4), [], False)
    ca = CacheAware(index, balance_abs_threshold=64, balance_rel_threshold=1.5)
    # 399 tokens cached on 0 outweigh its load of 100, but the guard (100 - 10 > 64 and
    # 100 > 1.5 x 10) sends the request to the least loaded.
    req = RequestInfo(token_ids=prompt + [1])
    assert ca.choose([T("0", load=100), T("1", load=10)], req).id == "1"
    assert req.cached_tokens == 0


def test_cache_aware_text_index_for_other_backends():
    ca = make_strategy("cache-aware")
    assert isinstance(ca.index, TextPrefixIndex)
    system = "You are a helpful assistant. " * 40
    first = ca.choose([T("a"), T("b")], RequestInfo(text=system + "Q1"))
    picks = Counter()
    for i in range(5):
        r = RequestInfo(text=system + f"question {i}")
        picks[ca.choose([T("a"), T("b")], r).id] += 1
        assert r.cached_tokens > 200
    assert picks[first.id] == 5


def test_text_index_matches_a_bounded_prefix_of_long_prompts():
    """Past max_chars nothing more is hashed, yet a long cached prompt is still a hit (not a
    "new prefix" because the match is capped), and a prompt differing past the cap matches."""
    index = TextPrefixIndex(chunk_chars=64, max_chars=1024)
    ca = CacheAware(index)
    doc = "A long shared document about paged attention. " * 200  # ~9,400 chars
    first = ca.choose([T("a"), T("b")], RequestInfo(text=doc + "Q0"))
    info = RequestInfo(text=doc + "Q1, with another question")
    assert ca.choose([T("a"), T("b")], info).id == first.id
    assert len(info.text_keys) == 16 and info.cached_tokens == index.matchable(info) == 256
    salted = RequestInfo(text=doc, cache_salt="tenant-b")  # another cache scope matches nothing
    assert index.match(salted, ["a", "b"]) == {"a": 0, "b": 0}


def test_round_robin_least_loaded_session():
    rr = make_strategy("round-robin")
    assert [rr.choose([T("1"), T("0")]).id for _ in range(4)] == ["0", "1", "0", "1"]
    ll = make_strategy("least-loaded")
    assert ll.choose([T("0", load=1000), T("1", load=3)]).id == "1"
    ll.started("x", RequestInfo(token_ids=list(range(500))))  # its own count without target loads
    assert ll.choose([T("x"), T("y")]).id == "y"
    s = make_strategy("session")
    targets = [T(str(i)) for i in range(4)]
    owners = {k: s.choose(targets, RequestInfo(session=k)).id for k in map(str, range(50))}
    assert all(s.choose(targets, RequestInfo(session=k)).id == v for k, v in owners.items())
    assert len(set(owners.values())) > 1
    rest = [t for t in targets if t.id != "0"]  # only the removed target's sessions move
    assert all(s.choose(rest, RequestInfo(session=k)).id == v for k, v in owners.items() if v != "0")
    with pytest.raises(ValueError, match="routing_policy"):
        make_strategy("fastest")


def test_router_decision_is_fast_with_many_cached_prefixes():
    """10,000 cached 4-block prefixes per replica; a 1,050-token prompt that hits both: well under
    0.5 ms per decision on average (the benchmark reports p99)."""
    import time

    index = BlockHashIndex(block_size=16)
    for r in ("0", "1"):
        hashes = []
        for p in range(10_000):
            hashes += hash_prompt_blocks([p, int(r)] * 32, 16)
        index.apply(r, hashes, [], False)
    system = list(range(1000))
    for r in ("0", "1"):  # both hold it: each decision matches on both, and each is a hit
        index.apply(r, hash_prompt_blocks(system, 16), [], False)
    ca = CacheAware(index)
    targets = [T("0", load=0), T("1", load=0)]
    t0 = time.perf_counter()
    for i in range(200):
        info = RequestInfo(token_ids=system + [i] * 50)
        ca.choose(targets, info)
        assert info.cached_tokens == 992
    assert (time.perf_counter() - t0) / 200 < 2e-3  # generous: a shared 2-core machine


def _gateway_router(strategy: str):
    from kvserve.gateway.config import parse_config
    from kvserve.gateway.router import Router
    from kvserve.gateway.state.memory import MemoryStore

    deps = [
        {"model_name": "m", "backend": {"base_url": f"http://127.0.0.1:{port}/v1", "model": "x"}}
        for port in (1, 2)
    ]
    cfg = parse_config({"model_list": deps, "router_settings": {"routing_strategy": strategy}})
    return Router(cfg, MemoryStore())


def test_gateway_router_cache_aware_and_session():
    import asyncio

    from kvserve.gateway.router import request_info

    async def picks(router, bodies, headers=None):
        out = []
        for b in bodies:
            info = request_info(b, headers or {})
            dep = await router.pick("m", set(), set(), info)
            router.strategy.started(dep.id, info)
            router.strategy.finished(dep.id, 0.01, info)
            out.append(dep.id)
        return out

    system = {"role": "system", "content": "You are a terse assistant for tenant A. " * 30}
    bodies = [{"messages": [system, {"role": "user", "content": f"question {i}"}]} for i in range(6)]
    ids = asyncio.run(picks(_gateway_router("cache-aware"), bodies))
    assert len(set(ids)) == 1  # the same system prompt sticks to the deployment that has it
    router = _gateway_router("session")
    ids = asyncio.run(picks(router, [{"prompt": str(i), "user": "u1"} for i in range(5)]))
    assert len(set(ids)) == 1
    assert asyncio.run(picks(router, [{"prompt": "x"}], {"x-session-id": "u1"})) == ids[:1]
    info = request_info({"messages": [system, {"role": "user", "content": "hi"}]}, {})
    assert info.text.startswith("system:You are") and info.text.endswith("user:hi\n")


def test_latency_based_probes_a_target_after_a_failure():
    """One failure (a 10 s penalty in the moving average) kept a deployment out for good: only
    a request sent there could lower its average again. Now it is probed every `probe_every`
    choices, and, being the faster one, wins the traffic back."""

    class T:
        def __init__(self, i: str) -> None:
            self.id, self.weight = i, 1.0

    a, b = T("a"), T("b")
    s = make_strategy("latency-based")
    latency = {"a": 0.5, "b": 0.4}
    for _ in range(10):
        t = s.choose([a, b])
        s.started(t.id)
        s.finished(t.id, latency[t.id])
    s.started("b")
    s.finished("b", None)  # one failure
    picks = []
    for _ in range(1000):  # about 14 probes bring b's average (2.3 s after the failure) under a's
        t = s.choose([a, b])
        s.started(t.id)
        s.finished(t.id, latency[t.id])
        picks.append(t.id)
    assert "b" in picks[:60] and picks[-100:].count("b") >= 95, picks.count("b")


def test_a_responses_stream_has_its_ids_rewritten_whatever_its_chunking():
    """The pd-proxy and the Ray Serve replicas pass a Responses stream on chunk by chunk: an id
    cut between two chunks (or a CRLF event end) must still come out naming the server, and
    every byte of the other events as it came."""
    import json

    from kvserve.routing.responses_ids import EventRewriter, decode_id

    resp = {"id": "resp_own", "previous_response_id": "resp_prev", "status": "completed"}
    created = json.dumps({"type": "response.created", "response": resp}).encode()
    completed = json.dumps({"type": "response.completed", "response": resp}).encode()
    delta = b'{"type": "response.output_text.delta", "delta": "hi"}'
    # (the last event without its blank line: the stream's end ends it)
    stream = (
        b"event: response.created\r\ndata: " + created + b"\r\n\r\ndata: " + delta + b"\n\ndata: " + completed
    )
    for size in (1, 7, len(stream)):
        ids = EventRewriter("replica-1")
        out = b"".join(ids.feed(stream[i : i + size]) for i in range(0, len(stream), size)) + ids.flush()
        events = [json.loads(line[5:]) for line in out.split(b"\n") if line.startswith(b"data:")]
        assert [e["type"] for e in events] == [
            "response.created",
            "response.output_text.delta",
            "response.completed",
        ]
        for e in (events[0], events[2]):
            assert decode_id(e["response"]["id"]) == ("replica-1", "resp_own"), size
            assert decode_id(e["response"]["previous_response_id"]) == ("replica-1", "resp_prev")
        assert events[1] == {"type": "response.output_text.delta", "delta": "hi"}
        assert out.startswith(b"event: response.created\n")


def test_prefix_text_is_the_engines_text_whatever_the_content_shape():
    """The Ray Serve router matched str() of a list of content parts ("[{'type': 'text', ..."),
    so one conversation sent as parts and as a string routed to different replicas (and a
    None content read "None"). Both routers now match the text the engine reads."""
    pytest.importorskip("ray.serve")
    from kvserve.deploy.ray_router import request_info as ray_info
    from kvserve.gateway.router import request_info as gw_info

    plain = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    for info in (lambda b: ray_info(["/v1/chat/completions", b, {}]), lambda b: gw_info(b, {})):
        a, b = info({"messages": plain}).text, info({"messages": parts}).text
        assert a == b == "system:You are terse.\nuser:Hello there\nassistant:\n", (a, b)
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]}
    assert ray_info(["/v1/responses", responses, {}]).text == "user:Hello there\n"
    assert ray_info(["/v1/completions", {"prompt": "Hi"}, {}]).text == "Hi"
