"""Gateway configuration: a bad key or value stops start-up with one line naming the key path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from kvserve.gateway.config import ConfigError, KeySpec, load_config, parse_config
from kvserve.gateway.keys import hash_key

OK = {"model_list": [{"model_name": "m", "backend": {"base_url": "http://127.0.0.1:1/v1", "model": "x"}}]}


def _with(path: str, value) -> dict:
    """OK with one value replaced or added at a dotted path (list indexes are numbers)."""
    cfg = yaml.safe_load(yaml.safe_dump(OK))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[int(last) if isinstance(node, list) else last] = value
    return cfg


@pytest.mark.parametrize(
    "path, value, message",
    [
        (
            "model_list.0.backend.timeout",
            "soon",
            "model_list.0.backend.timeout: Input should be a valid number",
        ),
        ("model_list.0.backend.tiemout", 5, "model_list.0.backend.tiemout: unknown key"),
        (
            "model_list.0.backend.base_url",
            "localhost:8000",
            "model_list.0.backend.base_url: Value error, must",
        ),
        (
            "model_list.0.backend.rpm",
            0,
            "model_list.0.backend.rpm: Input should be greater than or equal to 1",
        ),
        ("router_settings.routing_strategy", "fastest", "router_settings.routing_strategy: Input should be"),
        (
            "router_settings.fallbacks",
            {"m": ["nope"]},
            "router_settings.fallbacks.m: unknown model_name 'nope'",
        ),
        ("keys", [{"key": "a", "team": "t"}], "keys.0.team: unknown team 't'"),
        ("keys", [{"alias": "x"}], "keys.0: give exactly one of key or key_hash"),
        (
            "keys",
            [{"key": "a", "budget_duration": "fortnightly"}],
            "keys.0.budget_duration: Value error, 'fortnightly'",
        ),
        (
            "keys",
            [{"key": "env:KVSERVE_NO_SUCH_VAR"}],
            "keys.0.key: environment variable KVSERVE_NO_SUCH_VAR",
        ),
        ("keys", [{"key_hash": "3f1c..."}], "keys.0.key_hash: not a SHA-256 (64 hex digits)"),
        ("keys", [{"key": "a"}, {"key_hash": hash_key("a").upper()}], "keys.1: the same key as keys.0"),
        ("general_settings.state", "memcached://x", "general_settings.state: Value error, must be 'memory'"),
        ("response_cache.store", "memcached://x", "response_cache.store: Value error, must be 'memory'"),
        # an answer's TTL in milliseconds past what Redis takes: every store failed, with a warning
        ("response_cache.ttl", 1e300, "response_cache.ttl: Input should be less than or equal to 1000000"),
        ("router_settings.cooldown_time", 1e300, "router_settings.cooldown_time: Input should be less than"),
        ("model_list", [], "model_list: List should have at least 1 item"),
        (
            "router_settings.degradation",
            {"nope": {"threshold": 0.9, "action": "shed"}},
            "router_settings.degradation.nope: unknown model_name 'nope'",
        ),
        (
            "router_settings.degradation",
            {"m": {"threshold": 0.9, "action": "fallback"}},
            "router_settings.degradation.m.fallback: required with action 'fallback'",
        ),
        (
            "router_settings.degradation",
            {"m": {"threshold": 0.9, "action": "fallback", "fallback": "m"}},
            "router_settings.degradation.m.fallback: must be another model_name",
        ),
        (
            "router_settings.degradation",
            {"m": {"threshold": 0, "action": "shed"}},
            "router_settings.degradation.m.threshold: Input should be greater than 0",
        ),
        ("response_cache", {"models": ["x"]}, "response_cache.models: unknown model_name 'x'"),
        (
            "response_cache",
            {"semantic": {"embedding_model": "emb"}},
            "response_cache.semantic.embedding_model: unknown model_name 'emb'",
        ),
        ("response_cache", {"ttl": -1}, "response_cache.ttl: Input should be greater than 0"),
        ("general_settings.shutdown_timeout", -1, "general_settings.shutdown_timeout: Input should be"),
        # these started and then failed each request (a reservation TTL or a limit past what
        # Redis and the cost arithmetic take, a weight random.choices refuses)
        (
            "model_list.0.backend.timeout",
            float("inf"),
            "model_list.0.backend.timeout: Input should be a finite",
        ),
        ("model_list.0.backend.timeout", 1e308, "model_list.0.backend.timeout: Input should be less than"),
        (
            "model_list.0.backend.weight",
            float("inf"),
            "model_list.0.backend.weight: Input should be a finite",
        ),
        ("model_list.0.backend.rpm", 10**400, "model_list.0.backend.rpm: Input should be less than"),
        ("model_list.0.backend.max_context", 10**400, "model_list.0.backend.max_context: Input should be"),
        ("general_settings.reservation_ttl", 1e308, "general_settings.reservation_ttl: Input should be less"),
        # a per-model limit on a model not served would cap nothing
        ("teams.t.model_rpm_limit", {"gpt-4o": 5}, "teams.t.model_rpm_limit.gpt-4o: unknown model_name"),
        # taken and then dropped without a word: the strategy is not cache-aware
        (
            "router_settings.balance_abs_threshold",
            10,
            "router_settings: Value error, balance_abs_threshold: applies only to routing_strategy 'cache-",
        ),
    ],
)
def test_bad_config_names_the_key_path(path, value, message):
    with pytest.raises(ConfigError) as e:
        parse_config(_with(path, value))
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_good_config_defaults_secrets_and_ids(monkeypatch):
    monkeypatch.setenv("KVSERVE_TEST_BACKEND_KEY", "secret")
    cfg = parse_config(_with("model_list.0.backend.api_key", "env:KVSERVE_TEST_BACKEND_KEY"))
    assert cfg.model_list[0].backend.api_key == "secret"
    assert cfg.model_list[0].id == "m-0"
    assert cfg.router_settings.num_retries == 2 and cfg.general_settings.state == "memory"


def test_keys_are_kept_hashed(tmp_path):
    from kvserve.gateway.keys import KeyStore, open_database

    cfg = parse_config({**OK, "keys": [{"key": "sk-plain", "alias": "a"}, {"key_hash": hash_key("sk-h")}]})
    store = KeyStore(cfg, open_database(str(tmp_path / "k.db")))
    assert store.lookup("sk-plain").spec.alias == "a" and store.lookup("sk-h") is not None
    assert store.lookup("sk-other") is None
    assert "sk-plain" not in repr([k.public() for k in store.list()])
    key, rec = store.create(cfg.keys[0].model_copy(update={"key": None, "key_hash": None, "alias": "run"}))
    assert store.lookup(key).spec.alias == "run"
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("k.db*"))  # the file and its WAL
    assert key.encode() not in raw and hash_key(key).encode() in raw
    assert store.revoke(rec.key_hash) and store.lookup(key) is None


def test_a_key_hash_is_checked_and_normalized_and_keys_are_unique(tmp_path):
    """A key_hash in upper case never matched (hash_key writes lower case), and a key given
    twice or equal to the master key loaded silently with one entry's limits never applied."""
    from kvserve.gateway.keys import KeyStore, open_database

    cfg = parse_config({**OK, "keys": [{"key_hash": hash_key("sk-h").upper(), "alias": "h"}]})
    assert KeyStore(cfg, open_database(str(tmp_path / "k.db"))).lookup("sk-h").spec.alias == "h"
    master = {"master_key": "sk-m", "database": str(tmp_path / "k.db")}
    with pytest.raises(ConfigError) as e:
        parse_config({**OK, "keys": [{"key": "sk-m", "rpm": 1}], "general_settings": master})
    assert str(e.value) == "keys.0: the same key as general_settings.master_key"


def test_cli_exits_nonzero_with_one_line(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(_with("model_list.0.backend.weight", -1)))
    p = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "gateway", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: model_list.0.backend.weight: Input should be greater than 0"
    ]
    path.write_text("model_list: [\n")
    with pytest.raises(ConfigError, match=r"gw.yaml: line \d+: not valid YAML"):
        load_config(str(path))


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"database": "/nonexistent/dir/gw.db"},
            "error: general_settings.database: /nonexistent/dir/gw.db: unable",
        ),
        ({"state": "redis://127.0.0.1:notaport/0"}, "error: general_settings.state: Port could not be cast"),
    ],
)
def test_cli_names_a_database_or_state_url_it_cannot_open(tmp_path, settings, message):
    """These passed validation and then failed opening with a traceback (exit status 1)."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({**OK, "general_settings": settings}))
    p = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "gateway", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), p.stderr


def test_a_virtual_key_is_looked_up_off_the_event_loop_and_a_revoke_counts_at_once(tmp_path):
    """Every request with an admin-made key read SQLite on the event loop: a slow disk or a
    database locked by another instance (up to its 10 s busy timeout) stalled every request of
    the instance. Now the database is read in a worker thread, each time (a revoke on any
    instance counts at once)."""
    import asyncio
    import threading

    import httpx

    from kvserve.gateway.app import build_app

    gs = {"master_key": "sk-m", "database": str(tmp_path / "k.db")}
    app = build_app(parse_config({**OK, "general_settings": gs}), web_ui=False)
    keys = app.state.gateway.keys
    key, rec = keys.create(KeySpec(alias="run"))
    threads: list[int] = []
    keys.db.set_trace_callback(lambda sql: threads.append(threading.get_ident()) if " keys" in sql else None)

    async def run() -> tuple[int, list[httpx.Response]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            user, master = {"Authorization": f"Bearer {key}"}, {"Authorization": "Bearer sk-m"}
            out = [await c.get("/v1/models", headers=user)]
            out.append(await c.post(f"/admin/keys/{rec.key_hash}/revoke", headers=master))
            out.append(await c.get("/v1/models", headers=user))
        return threading.get_ident(), out

    loop_thread, (ok, revoked, gone) = asyncio.run(run())
    assert ok.status_code == 200 and revoked.status_code == 200 and gone.status_code == 401, gone.text
    assert len(threads) == 3 and loop_thread not in threads  # every key query ran in a worker thread


def test_a_key_whose_team_left_the_config_may_use_nothing(tmp_path):
    """A key made through the admin API for a team, after the team was removed from the config:
    read as a key without a team it lost the team's `models` and limits, so it could call every
    model with no team budget. It may now use no model, and says why."""
    import asyncio

    import httpx

    from kvserve.gateway.app import build_app

    gs = {"master_key": "sk-m", "database": str(tmp_path / "k.db")}
    teams = {"t": {"models": ["m"], "max_budget": 1}}
    before = build_app(parse_config({**OK, "teams": teams, "general_settings": gs}), web_ui=False)
    key, _ = before.state.gateway.keys.create(KeySpec(alias="member", team="t"))
    app = build_app(parse_config({**OK, "general_settings": gs}), web_ui=False)  # the team removed
    h, body = (
        {"Authorization": f"Bearer {key}"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return [
                await c.get("/v1/models", headers=h),
                await c.post("/v1/chat/completions", json=body, headers=h),
            ]

    models, chat = asyncio.run(run())
    assert models.status_code == 200 and models.json()["data"] == []
    err = chat.json()["error"]
    assert chat.status_code == 403 and err["type"] == "permission_denied" and "'t'" in err["message"], err


def test_fallbacks_in_litellms_list_form_are_read_as_the_map_they_mean():
    """A LiteLLM config writes router_settings.fallbacks as a list of one-alias maps; it was
    refused at start ("Input should be a valid dictionary"): now read as {alias: [aliases]}."""
    deps = [{"model_name": m, "backend": {"base_url": "http://127.0.0.1:1/v1", "model": "x"}} for m in "abc"]
    rs = {"fallbacks": [{"a": ["b", "c"]}, {"b": ["c"]}], "context_window_fallbacks": [{"a": ["c"]}]}
    cfg = parse_config({"model_list": deps, "router_settings": rs})
    assert cfg.router_settings.fallbacks == {"a": ["b", "c"], "b": ["c"]}
    assert cfg.router_settings.context_window_fallbacks == {"a": ["c"]}
    with pytest.raises(ConfigError, match="router_settings.fallbacks: .*'a' is given twice"):
        parse_config({"model_list": deps, "router_settings": {"fallbacks": [{"a": ["b"]}, {"a": ["c"]}]}})
    with pytest.raises(ConfigError, match="router_settings.fallbacks.b: unknown model_name 'z'"):
        parse_config({"model_list": deps, "router_settings": {"fallbacks": [{"b": ["z"]}]}})


def test_a_model_group_alias_must_name_a_group_and_be_a_name_of_its_own():
    deps = [{"model_name": m, "backend": {"base_url": "http://127.0.0.1:1/v1", "model": "x"}} for m in "ab"]
    rs = {"model_group_alias": {"gpt-4": "a", "hid": {"model": "b", "hidden": True}}}
    cfg = parse_config(
        {"model_list": deps, "router_settings": rs, "keys": [{"key": "sk-k", "models": ["gpt-4"]}]}
    )
    assert (
        cfg.names() == ["a", "b", "gpt-4", "hid"]
        and cfg.group_of("gpt-4") == "a"
        and cfg.group_of("b") == "b"
    )
    assert cfg.router_settings.model_group_alias["hid"].hidden is True
    with pytest.raises(ConfigError, match="model_group_alias.a: 'a' is a model_name already"):
        parse_config({"model_list": deps, "router_settings": {"model_group_alias": {"a": "b"}}})
    with pytest.raises(ConfigError, match="model_group_alias.x.model: unknown model_name 'gpt-4'"):
        parse_config(
            {"model_list": deps, "router_settings": {"model_group_alias": {"gpt-4": "a", "x": "gpt-4"}}}
        )
