"""Three `kvserve gateway` processes sharing one real Redis behave as one: exact rpm and budget
admission under concurrency, shared cooldowns and keys, and reservations of a gateway killed
mid-request expire."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from gateway_utils import FaultBackend, GatewayProcess, RedisServer, deployment

MSG = [{"role": "user", "content": "one two three"}]  # 3 "tokens" at the fault backend
PRICE = {"input_cost_per_token": 0.5, "output_cost_per_token": 0.25}  # 3 * 0.5 + 2 * 0.25 = 2.0 each
K = 10


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cache_redis():
    """The response cache's own Redis (response_cache.store)."""
    r = RedisServer()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def fault():
    fb = FaultBackend()
    yield fb
    fb.stop()


def _config(fault, redis_server, db: str, cache_url: str | None = None, **general) -> dict:
    u = fault.url + "/v1"
    return {
        "model_list": [
            deployment("ok", u, "ok"), deployment("priced", u, "ok", **PRICE),
            deployment("held", u, "hold-60", **PRICE),
            {"model_name": "cool", "id": "sick", "backend": {"base_url": u, "model": "fail-500"}},
            {"model_name": "cool", "id": "well", "backend": {"base_url": u, "model": "ok"}},
        ],
        "router_settings": {"allowed_fails": 2, "cooldown_time": 120, "retry_backoff_base": 0.01},
        "teams": {"mteam": {"model_rpm_limit": {"ok": 1},
                            "model_max_budget": {"priced": {"budget_limit": 2.0}}}},
        "keys": [{"key": "sk-rpm50", "rpm": 50}, {"key": "sk-budget", "max_budget": 2.0 * K},
                 {"key": "sk-kill", "max_budget": 2.0}, {"key": "sk-any"}, {"key": "sk-rpm3", "rpm": 3},
                 {"key": "sk-restart", "alias": "restart", "max_budget": 5.0, "budget_duration": "30d"}],
        "general_settings": {"master_key": "sk-master", "state": redis_server.url, "database": db, **general},
        **({"response_cache": {"store": cache_url, "ttl": 600}} if cache_url else {}),
    }  # fmt: skip


@pytest.fixture(scope="module")
def gws(fault, redis_server, cache_redis, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-redis")
    cfg = _config(fault, redis_server, str(tmp / "shared.db"), cache_redis.url)
    gs = [GatewayProcess(cfg, str(tmp), f"gw{i}", wait=False) for i in range(3)]
    for g in gs:
        g.wait()
    yield gs
    for g in gs:
        g.stop()
    for g in gs:
        assert "Traceback" not in g.logs(), g.logs()


def _burst(gws, key: str, model: str, n: int) -> list[httpx.Response]:
    """n concurrent requests spread round-robin over the instances."""

    async def go():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            body = {"model": model, "messages": MSG, "max_tokens": 2}
            h = {"Authorization": f"Bearer {key}"}
            return await asyncio.gather(
                *(
                    c.post(gws[i % len(gws)].url + "/v1/chat/completions", json=body, headers=h)
                    for i in range(n)
                )
            )

    return asyncio.run(go())


def test_rpm_is_exact_across_three_instances(gws):
    rs = _burst(gws, "sk-rpm50", "ok", 300)
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 50 and codes.count(429) == 250
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in rs if r.status_code == 429)
    assert {r.headers["x-ratelimit-limit-requests"] for r in rs} == {"50"}


def test_budget_is_exact_across_three_instances(gws):
    rs = _burst(gws, "sk-budget", "priced", 10 * K)
    codes = [r.status_code for r in rs]
    # refused: 429 while reservations in flight may settle for less, 400 once the spend alone
    # leaves no room (the budget has no budget_duration: no retry would pass)
    assert codes.count(200) == K and codes.count(429) + codes.count(400) == 9 * K
    assert {r.json()["error"]["code"] for r in rs if r.status_code != 200} == {"budget_exceeded"}
    m = {"Authorization": "Bearer sk-master"}
    rows = httpx.get(gws[1].url + "/admin/spend", params={"group_by": "model"}, headers=m).json()["data"]
    spent = sum(r["spend"] for r in rows if r["model"] == "priced")
    deadline = time.monotonic() + 10  # other instances flush their spend log every 0.5 s
    while spent < 2.0 * K and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = httpx.get(gws[1].url + "/admin/spend", params={"group_by": "model"}, headers=m).json()["data"]
        spent = sum(r["spend"] for r in rows if r["model"] == "priced")
    assert spent == pytest.approx(2.0 * K) and spent <= 2.0 * K + 1e-9


def test_cooldown_is_shared(gws, fault):
    h = {"Authorization": "Bearer sk-any"}
    body = {"model": "cool", "messages": MSG, "max_tokens": 2}
    start = fault.count("fail-500")
    for _ in range(40):
        assert httpx.post(gws[0].url + "/v1/chat/completions", json=body, headers=h).status_code == 200
        if fault.count("fail-500") - start >= 2:
            break
    cooled = fault.count("fail-500")
    assert cooled - start == 2
    for i in range(12):  # the other instances never tried it, yet send it nothing
        r = httpx.post(gws[1 + i % 2].url + "/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 200 and r.headers["x-kvserve-deployment"] == "well"
    assert fault.count("fail-500") == cooled


def test_keys_made_on_one_instance_work_and_die_on_the_others(gws):
    m = {"Authorization": "Bearer sk-master"}
    made = httpx.post(gws[0].url + "/admin/keys", json={"models": ["ok"]}, headers=m).json()
    h = {"Authorization": f"Bearer {made['key']}"}
    body = {"model": "ok", "messages": MSG, "max_tokens": 2}
    assert httpx.post(gws[1].url + "/v1/chat/completions", json=body, headers=h).status_code == 200
    assert httpx.post(gws[2].url + f"/admin/keys/{made['key_hash']}/revoke", headers=m).status_code == 200
    assert httpx.post(gws[1].url + "/v1/chat/completions", json=body, headers=h).status_code == 401


def test_a_key_blocked_or_regenerated_on_one_instance_counts_on_the_others(gws):
    """LiteLLM's /key/block and /key/regenerate change a key in Redis (shared_keys.py), so every
    instance refuses the blocked or replaced key at once."""
    m = {"Authorization": "Bearer sk-master"}
    body = {"model": "ok", "messages": MSG, "max_tokens": 2}
    chat = lambda g, key: httpx.post(g.url + "/v1/chat/completions", json=body,  # noqa: E731
                                     headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    key = httpx.post(gws[0].url + "/key/generate", json={"key_alias": "rotated"}, headers=m).json()["key"]
    assert chat(gws[1], key).status_code == 200
    assert httpx.post(gws[2].url + "/key/block", json={"key": key}, headers=m).status_code == 200
    blocked = chat(gws[1], key)
    assert blocked.status_code == 401 and "Key is blocked" in blocked.json()["error"]["message"], blocked.text
    assert httpx.post(gws[0].url + "/key/unblock", json={"key": key}, headers=m).status_code == 200
    assert chat(gws[1], key).status_code == 200
    new = httpx.post(gws[2].url + "/key/regenerate", json={"key": key}, headers=m).json()["key"]
    assert chat(gws[1], key).status_code == 401 and chat(gws[0], new).status_code == 200


def test_a_budget_is_rebuilt_from_the_spend_log_when_redis_comes_back_empty(gws, redis_server):
    """Budget spend lived only in Redis: a Redis restarted without persistence (an operator's,
    or the manifest's before it had a volume) came back with every key's spend at 0, and each
    key could spend its whole budget again. The gateway now rebuilds a budget it finds missing
    from the spend log (the shared database), once, and says so in its log."""
    h = {"Authorization": "Bearer sk-restart"}
    body = {"model": "priced", "messages": MSG, "max_tokens": 2}  # 2.0 each
    chat = lambda g: httpx.post(g.url + "/v1/chat/completions", json=body, headers=h, timeout=30)  # noqa: E731
    assert [chat(gws[0]).status_code for _ in range(2)] == [200, 200]  # 4.0 of 5.0 spent
    redis_server.restart()  # persistence off: it comes back empty
    for g in (gws[0], gws[1]):  # the rebuilding instance, then another one
        r = chat(g)
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
        assert r.json()["error"]["type"] == "budget_exceeded", r.text  # LiteLLM's (was rate_limit_error)
        # LiteLLM's sentence, the spend as the Lua admission read it (was "key: budget 5 limit reached")
        head = "Budget has been exceeded! Key=restart Current cost: 4.0, Max budget: 5.0; this request may"
        assert r.json()["error"]["message"].startswith(head), r.text
    assert "budget of key restart" in gws[0].logs() and "rebuilt from the spend log" in gws[0].logs()


def test_reservation_of_a_killed_instance_expires(fault, redis_server, tmp_path):
    ttl = 4.0
    cfg = _config(fault, redis_server, str(tmp_path / "kill.db"), reservation_ttl=ttl)
    victim, survivor = (
        GatewayProcess(cfg, str(tmp_path), "victim"),
        GatewayProcess(cfg, str(tmp_path), "survivor"),
    )
    try:
        body = {"model": "held", "messages": MSG, "max_tokens": 2}
        h = {"Authorization": "Bearer sk-kill"}
        before = fault.count("hold-60")

        def doomed():
            try:
                httpx.post(victim.url + "/v1/chat/completions", json=body, headers=h, timeout=60)
            except httpx.HTTPError:
                pass  # its gateway dies under it

        t = threading.Thread(target=doomed, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while fault.count("hold-60") == before and time.monotonic() < deadline:
            time.sleep(0.05)
        admitted = time.monotonic()  # the whole budget (one request) is reserved from here on
        victim.kill9()
        r = httpx.post(survivor.url + "/v1/chat/completions", json={**body, "model": "priced"}, headers=h)
        if time.monotonic() - admitted < ttl - 0.5:  # still within the reservation's life
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
        deadline = time.monotonic() + 30
        while r.status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.25)
            r = httpx.post(survivor.url + "/v1/chat/completions", json={**body, "model": "priced"}, headers=h)
        assert r.status_code == 200  # the dead instance's reservation expired; the budget came back
        assert time.monotonic() - admitted >= ttl / 2  # it was the TTL: nobody settled it
        t.join(5)
    finally:
        victim.stop()
        survivor.stop()


def test_cached_answers_in_their_own_redis_never_evict_rate_limit_windows(gws, redis_server, cache_redis):
    """The response cache lived in the state store's Redis: under maxmemory (the shipped
    manifest's volatile-lru) its answers, which have TTLs, made Redis evict rate-limit windows,
    which have TTLs too, and a key's rpm began again. With `response_cache.store` the answers
    fill a Redis of their own (evicting only each other there) and the limit holds."""
    state, cache = redis_server.client, cache_redis.client
    state.config_set("maxmemory", "2mb")
    state.config_set("maxmemory-policy", "volatile-lru")
    cache.config_set("maxmemory", "2mb")
    cache.config_set("maxmemory-policy", "allkeys-lru")
    chat = lambda key, text, n: httpx.post(  # noqa: E731
        gws[0].url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
        json={"model": "ok", "messages": [{"role": "user", "content": text}], "max_tokens": n,
              "temperature": 0},
    )  # fmt: skip
    try:
        assert [chat("sk-rpm3", f"limited {i}", 2).status_code for i in range(3)] == [200] * 3
        for i in range(25):  # ~200 KB answers: ~5 MB into 2 MB
            r = chat("sk-any", f"filler {i}", 50_000)
            assert r.status_code == 200 and r.headers["x-kvserve-cache"] == "miss", r.text
        assert cache.dbsize() < 25  # (the cache's Redis did evict)
        assert state.keys("kvgw:rc:*") == []  # nothing cached in the state store
        r = chat("sk-rpm3", "limited 3", 2)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    finally:
        for client in (state, cache):
            client.config_set("maxmemory", "0")
            client.config_set("maxmemory-policy", "noeviction")


def test_api_made_keys_live_in_redis_so_instances_with_their_own_database_share_them(redis_server, tmp_path):
    """With an instance per host (Kubernetes pods, each its own SQLite `database`), a key made
    through the admin API (or LiteLLM's /key/generate) worked only on the instance that made it:
    a 401 on the others, and a revoke on another was a 404 while the key kept working. With a
    Redis state store the keys live there: made, updated and revoked on any instance, seen by
    all; a key made before (in one instance's database only) is shared from its first use, and
    a revoke elsewhere is not undone by that instance's local copy."""
    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import KeySpec, parse_config

    def app(name: str):
        cfg = {"model_list": [deployment("a", "http://127.0.0.1:1/v1", "x")],
               "general_settings": {"master_key": "sk-master", "state": redis_server.url,
                                    "database": str(tmp_path / f"{name}.db")}}  # fmt: skip
        return build_app(parse_config(cfg), web_ui=False)

    a, b = app("a"), app("b")
    old, _ = a.state.gateway.keys.create(KeySpec(alias="before"))  # in a's database only
    m = {"Authorization": "Bearer sk-master"}

    async def run() -> None:
        ca = httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://a")
        cb = httpx.AsyncClient(transport=httpx.ASGITransport(app=b), base_url="http://b")
        async with ca, cb:
            made = (await ca.post("/key/generate", json={"models": ["a"]}, headers=m)).json()
            h = {"Authorization": f"Bearer {made['key']}"}
            assert (await cb.get("/v1/models", headers=h)).status_code == 200
            up = await cb.post("/key/update", json={"key": made["key"], "rpm_limit": 7}, headers=m)
            assert up.status_code == 200, up.text
            info = (await ca.get("/key/info", params={"key": made["token"]}, headers=m)).json()["info"]
            assert info["rpm_limit"] == 7, info
            listed = {k["key_hash"] for k in (await cb.get("/admin/keys", headers=m)).json()["data"]}
            assert made["token"] in listed
            assert (await cb.post("/key/delete", json={"keys": [made["key"]]}, headers=m)).status_code == 200
            assert (await ca.get("/v1/models", headers=h)).status_code == 401
            # made before keys were shared: shared at its first use, and a revoke elsewhere holds
            ho = {"Authorization": f"Bearer {old}"}
            assert (await ca.get("/v1/models", headers=ho)).status_code == 200
            assert (await cb.get("/v1/models", headers=ho)).status_code == 200
            assert (
                await cb.post("/key/delete", json={"key_aliases": ["before"]}, headers=m)
            ).status_code == 200
            assert (await ca.get("/v1/models", headers=ho)).status_code == 401
            await a.state.gateway.store.close()
            await b.state.gateway.store.close()

    asyncio.run(run())


def test_a_users_budget_caps_all_its_keys_on_every_instance(gws, redis_server):
    """LiteLLM's /user/new was a route 404, so a per-person budget over several keys could not be
    set. A user's max_budget now caps its keys together, in the shared Redis; a user's budget
    the store lost is rebuilt from the spend log's rows of the user."""
    m = {"Authorization": "Bearer sk-master"}
    body = {"user_id": "carol", "max_budget": 5.0, "key_alias": "carol-1"}
    made = httpx.post(gws[0].url + "/user/new", json=body, headers=m)
    assert made.status_code == 200, made.text
    second = httpx.post(gws[1].url + "/key/generate", json={"user_id": "carol"}, headers=m).json()["key"]
    chat = {"model": "priced", "messages": MSG, "max_tokens": 2}  # 2.0 each
    ask = lambda g, key: httpx.post(g.url + "/v1/chat/completions", json=chat,  # noqa: E731
                                    headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert [ask(gws[0], made.json()["key"]).status_code, ask(gws[1], second).status_code] == [200, 200]
    r = ask(gws[2], second)  # 4.0 of her 5.0 spent, by two keys: neither key has a budget of its own
    assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded", r.text
    assert "Budget has been exceeded! User=carol Current cost: 4.0, Max budget: 5.0" in r.text, r.text
    deadline = time.monotonic() + 10  # other instances flush their spend log every 0.5 s
    while True:
        info = httpx.get(gws[2].url + "/user/info", params={"user_id": "carol"}, headers=m).json()
        if info["user_info"]["spend"] >= 4.0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert info["user_info"]["spend"] == pytest.approx(4.0) and len(info["keys"]) == 2, info
    redis_server.restart()  # persistence off: her budget's spend is gone from the store
    r = ask(gws[1], made.json()["key"])
    assert r.status_code == 400 and "User=carol Current cost: 4.0" in r.text, r.text


def test_a_keys_per_model_limits_hold_on_every_instance(gws, redis_server):
    """LiteLLM's model_rpm_limit, model_tpm_limit and model_max_budget on /key/generate were a
    400 unsupported_parameter. Each caps the key on that model alone, counted in the shared Redis,
    refused in LiteLLM's words (429 model_per_key; budget_exceeded), and /key/info shows them."""
    m = {"Authorization": "Bearer sk-master"}
    body = {"model_rpm_limit": {"ok": 2}, "model_tpm_limit": {"priced": 1000},
            "model_max_budget": {"priced": {"budget_limit": 4.0, "time_period": "1d"}}}  # fmt: skip
    made = httpx.post(gws[0].url + "/key/generate", json=body, headers=m)
    assert made.status_code == 200, made.text
    key = made.json()["key"]
    rs = [r.status_code for r in _burst(gws, key, "ok", 6)]
    assert sorted(rs) == [200, 200, 429, 429, 429, 429], rs
    refused = _burst(gws, key, "ok", 1)[0]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
    assert "Rate limit exceeded for model_per_key:" in refused.json()["error"]["message"], refused.text
    ask = lambda g: httpx.post(g.url + "/v1/chat/completions", timeout=30,  # noqa: E731
                               json={"model": "priced", "messages": MSG, "max_tokens": 2},
                               headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert [ask(gws[1]).status_code, ask(gws[2]).status_code] == [200, 200]  # (ok's rpm is ok's alone)
    r = ask(gws[0])  # 4.0 of priced's 4.0 spent
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
    assert "exceeded budget for model=priced. Current cost: 4.0, Max budget: 4.0" in r.text, r.text
    info = httpx.get(gws[1].url + "/key/info", params={"key": key}, headers=m).json()["info"]
    assert info["model_max_budget"] == {"priced": {"budget_limit": 4.0, "time_period": "1d"}}, info
    assert (info["model_rpm_limit"], info["model_tpm_limit"]) == ({"ok": 2}, {"priced": 1000}), info
    time.sleep(1.5)  # (the other instances flush their spend log every 0.5 s)
    redis_server.restart()  # persistence off: the model budget's spend is rebuilt from the spend log
    r = ask(gws[1])
    assert r.status_code == 429 and "model=priced. Current cost: 4.0" in r.text, r.text
    typo = httpx.post(gws[0].url + "/key/generate", json={"model_rpm_limit": {"gpt-4o": 1}}, headers=m)
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "model_rpm_limit", typo.text


def test_a_user_made_at_once_on_several_instances_is_made_once(gws):
    """/user/new read the user and then wrote it: the same user_id made on two instances at the
    same moment was made by both (two 200s, the second overwriting the first's budget). The
    creation is one atomic step in Redis: exactly one 200 per user, the others LiteLLM's 409."""
    m = {"Authorization": "Bearer sk-master"}

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(
                c.post(g.url + "/user/new", headers=m,
                       json={"user_id": f"racer-{i}", "max_budget": float(j + 1), "auto_create_key": False})
                for i in range(8) for j, g in enumerate(gws)
            ))  # fmt: skip

    rs = asyncio.run(go())
    for i in range(8):
        codes = sorted(r.status_code for r in rs[i * len(gws) : (i + 1) * len(gws)])
        assert codes == [200] + [409] * (len(gws) - 1), (i, codes)
    made = {r.json()["user_id"]: r.json()["max_budget"] for r in rs if r.status_code == 200}
    for user_id, budget in made.items():  # the one made is the one every instance reads
        for g in gws:
            info = httpx.get(g.url + "/user/info", params={"user_id": user_id}, headers=m).json()
            assert info["user_info"]["max_budget"] == budget, (user_id, info)


def test_a_users_model_max_budget_caps_that_model_over_all_its_keys(gws):
    """LiteLLM's users take model_max_budget too (it was a 400 unsupported_parameter on
    /user/new): it caps what all the user's keys spend on that model, the other models free."""
    m = {"Authorization": "Bearer sk-master"}
    body = {"user_id": "dave", "model_max_budget": {"priced": {"max_budget": 4.0}}, "auto_create_key": False}
    made = httpx.post(gws[0].url + "/user/new", json=body, headers=m)
    assert made.status_code == 200, made.text
    keys = [httpx.post(gws[i].url + "/key/generate", json={"user_id": "dave"}, headers=m).json()["key"]
            for i in range(2)]  # fmt: skip
    ask = lambda g, key, model: httpx.post(g.url + "/v1/chat/completions", timeout=30,  # noqa: E731
                                           json={"model": model, "messages": MSG, "max_tokens": 2},
                                           headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert ask(gws[1], keys[0], "priced").status_code == 200
    assert ask(gws[2], keys[1], "priced").status_code == 200
    r = ask(gws[0], keys[1], "priced")  # 4.0 of dave's 4.0 on priced, by two keys
    assert r.status_code == 400 and r.json()["error"]["code"] == "budget_exceeded", r.text
    assert "LiteLLM User: dave, exceeded budget for model=priced. Current cost: 4.0" in r.text, r.text
    assert ask(gws[0], keys[0], "ok").status_code == 200
    info = httpx.get(gws[2].url + "/user/info", params={"user_id": "dave"}, headers=m).json()
    assert info["user_info"]["model_max_budget"] == {"priced": {"budget_limit": 4.0}}, info
    # a user id may hold any text: its own budget is not taken for a model's
    body = {"user_id": "eve:model:ok", "max_budget": 2.0, "key_alias": "eve"}
    eve = httpx.post(gws[0].url + "/user/new", json=body, headers=m).json()["key"]
    assert ask(gws[1], eve, "priced").status_code == 200
    r = ask(gws[2], eve, "priced")
    assert r.status_code == 400 and "User=eve:model:ok Current cost: 2.0" in r.text, r.text


def test_a_teams_per_model_limits_cap_its_keys_unless_a_key_has_its_own_model_budget(gws):
    """LiteLLM's teams take model_rpm_limit, model_tpm_limit and model_max_budget: they cap the
    team's keys together on that model; a key's own model_max_budget for the model stands in
    for the team's (LiteLLM's rule), its rate limits still the team's."""
    m = {"Authorization": "Bearer sk-master"}
    plain = httpx.post(gws[0].url + "/key/generate", json={"team_id": "mteam"}, headers=m).json()["key"]
    own = {"team_id": "mteam", "model_max_budget": {"priced": {"budget_limit": 4.0}}}
    owner = httpx.post(gws[1].url + "/key/generate", json=own, headers=m).json()["key"]
    ask = lambda g, key, model: httpx.post(g.url + "/v1/chat/completions", timeout=30,  # noqa: E731
                                           json={"model": model, "messages": MSG, "max_tokens": 2},
                                           headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert ask(gws[0], plain, "priced").status_code == 200  # 2.0: the team's 2.0 on priced
    r = ask(gws[1], plain, "priced")
    assert r.status_code == 400 and "LiteLLM Team: mteam, exceeded budget for model=priced" in r.text, r.text
    assert ask(gws[2], owner, "priced").status_code == 200  # its own 4.0 stands in for the team's
    assert ask(gws[0], owner, "ok").status_code == 200
    r = ask(gws[1], plain, "ok")  # the team's 1 a minute on ok, used by the other key
    assert r.status_code == 429 and "Rate limit exceeded for model_per_team: mteam:ok" in r.text, r.text
    info = httpx.get(gws[2].url + "/team/info", params={"team_id": "mteam"}, headers=m).json()["team_info"]
    assert info["model_rpm_limit"] == {"ok": 1} and info["model_max_budget"]["priced"]["budget_limit"] == 2.0
