"""LiteLLM's proxy management paths at the gateway (/key/generate, /key/info, /key/update,
/key/delete, /key/list, /model/info, /team/info, /team/list): a LiteLLM proxy user's scripts
called these and met route 404s."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import sqlite3
import time

import httpx
import pytest

from kvserve.gateway.app import build_app
from kvserve.gateway.config import KeySpec, parse_config
from kvserve.gateway.keys import open_database
from kvserve.gateway.spend import SpendLog, SpendRow

BACKEND = {"base_url": "http://127.0.0.1:1/v1", "model": "x", "api_key": "sk-backend-secret"}
CFG = {
    "model_list": [{"model_name": "a", "backend": BACKEND}, {"model_name": "b", "backend": BACKEND}],
    "teams": {"red": {"rpm": 10}, "blue": {"models": ["a"]}},
}
MASTER = {"Authorization": "Bearer sk-master"}


def _run(tmp_path, calls, rows=(), app=False):
    """calls(client) on an in-process gateway with a master key and its own database (its spend
    log holding `rows`); app=True: calls(client, app)."""
    gs = {"master_key": "sk-master", "database": str(tmp_path / "gw.db")}
    gw = build_app(parse_config({**CFG, "general_settings": gs}), web_ui=False)
    for row in rows:
        gw.state.gateway.spend.record(row)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as c:
            return await (calls(c, gw) if app else calls(c))

    return asyncio.run(go())


def _models(c, key):
    return c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_a_key_made_updated_and_deleted_with_litellms_paths_and_shapes(tmp_path):
    async def calls(c):
        body = {"key_alias": "app", "models": ["a"], "team_id": "red", "rpm_limit": 5, "tpm_limit": 900,
                "max_budget": 2.5, "budget_duration": "30d", "metadata": {"env": "prod"},
                "user_id": None}  # fmt: skip
        made = await c.post("/key/generate", json=body, headers=MASTER)
        assert made.status_code == 200, made.text
        m = made.json()
        key = m["key"]
        assert key.startswith("sk-") and len(m["token"]) == 64 and m["expires"] is None, m
        assert m["key_name"] == f"sk-...{key[-4:]}", m  # (LiteLLM's: the key's end, not its hash's)
        assert (m["key_alias"], m["models"], m["team_id"], m["rpm_limit"], m["tpm_limit"]) == (
            "app",
            ["a"],
            "red",
            5,
            900,
        )
        assert (m["max_budget"], m["budget_duration"], m["metadata"]) == (2.5, "30d", {"env": "prod"}), m
        assert [x["id"] for x in (await _models(c, key)).json()["data"]] == ["a"]
        # /key/info: the master key reads any key (by the key or its hash); a key reads itself
        own = await c.get("/key/info", headers={"Authorization": f"Bearer {key}"})
        assert own.status_code == 200 and own.json()["info"]["token"] == m["token"], own.text
        by_hash = await c.get("/key/info", params={"key": m["token"]}, headers=MASTER)
        assert by_hash.json()["info"]["key_alias"] == "app" and by_hash.json()["info"]["spend"] == 0.0
        # /key/update: the fields given change, the others stay; models [] is every model (LiteLLM's)
        # (a null is no change, as LiteLLM reads it: scripts send the whole object back)
        change = {"key": key, "models": [], "rpm_limit": 7, "key_alias": None, "max_budget": None}
        up = await c.post("/key/update", json=change, headers=MASTER)
        assert up.status_code == 200 and up.json()["rpm_limit"] == 7, up.text
        assert up.json()["max_budget"] == 2.5 and up.json()["key_alias"] == "app", up.text
        assert [x["id"] for x in (await _models(c, key)).json()["data"]] == ["a", "b"]
        team_wide = {"models": ["all-team-models"], "team_id": "red"}  # (LiteLLM's every-model names)
        every = await c.post("/key/generate", json=team_wide, headers=MASTER)
        assert every.status_code == 200 and every.json()["models"] == [], every.text
        assert len((await _models(c, every.json()["key"])).json()["data"]) == 2
        await c.post("/key/delete", json={"keys": [every.json()["token"]]}, headers=MASTER)
        listed = (await c.get("/key/list", headers=MASTER)).json()
        assert listed["keys"] == [m["token"]] and listed["total_count"] == 1, listed
        # /key/delete by alias; the key is refused after, and unknown names are a 404
        gone = await c.post("/key/delete", json={"key_aliases": ["app"]}, headers=MASTER)
        assert gone.status_code == 200 and gone.json() == {"deleted_keys": ["app"]}, gone.text
        assert (await _models(c, key)).status_code == 401
        missing = await c.post("/key/delete", json={"keys": [key]}, headers=MASTER)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
        return True

    assert _run(tmp_path, calls)


def test_litellm_key_fields_the_gateway_cannot_honour_are_refused_by_name(tmp_path):
    async def calls(c):
        out = []
        for body in ({"soft_budget": 1.0}, {"aliases": {"x": "a"}}, {"key": "sk-mine"}, {"rpm_limit": 0},
                     {"models": ["nope"]}, {"team_id": "green"},
                     {"team_id": "blue", "models": ["a", "b"]}):  # fmt: skip
            r = await c.post("/key/generate", json=body, headers=MASTER)
            out.append((r.status_code, r.json()["error"]["param"]))
        user = (await c.post("/key/generate", json={}, headers=MASTER)).json()["key"]
        other = (await c.post("/key/generate", json={}, headers=MASTER)).json()["key"]
        peek = await c.get("/key/info", params={"key": other}, headers={"Authorization": f"Bearer {user}"})
        self_made = await c.post("/key/generate", json={}, headers={"Authorization": f"Bearer {user}"})
        return out, peek.status_code, self_made.status_code, (await c.get("/key/list", headers=MASTER)).json()

    out, peek, self_made, listed = _run(tmp_path, calls)
    # (the last: model b is not among team blue's models, the key could never use it)
    assert out == [(400, "soft_budget"), (400, "aliases"), (400, "key"), (400, "rpm_limit"), (404, "models"),
                   (400, "team_id"), (400, "models")], out  # fmt: skip
    assert peek == 401 and self_made == 401 and listed["total_count"] == 2  # none of the refused was made


def test_a_key_with_a_duration_expires(tmp_path, monkeypatch):
    """LiteLLM's `duration`: the key works until then, then is a 401 (and /key/info shows when),
    which says, in LiteLLM's words, that the key expired and when (it was "unknown, revoked or
    expired key": its user could not tell which)."""

    async def calls(c):
        made = (await c.post("/key/generate", json={"duration": "1h"}, headers=MASTER)).json()
        before = (await _models(c, made["key"])).status_code
        later = time.time() + 3601
        monkeypatch.setattr("kvserve.gateway.keys.time.time", lambda: later)
        after = await _models(c, made["key"])
        return made, before, after

    made, before, after = _run(tmp_path, calls)
    assert made["expires"] is not None and before == 200
    assert after.status_code == 401, after.text
    msg = f"Authentication Error - Expired Key. Key Expiry time {made['expires']} and current time "
    assert after.json()["error"]["message"].startswith(msg), after.text


def test_key_info_without_a_key_describes_the_calling_key_the_master_key_too(tmp_path):
    """LiteLLM's /key/info with no ?key describes the key that calls it; the master key's call
    was a 400 `key: which key` (a LiteLLM user's "who am I" check of the proxy)."""

    async def calls(c):
        return await c.get("/key/info", headers=MASTER), await c.get("/key/info")

    master, nobody = _run(tmp_path, calls)
    assert master.status_code == 200, master.text
    info = master.json()["info"]
    assert info["token"] == hashlib.sha256(b"sk-master").hexdigest() and info["source"] == "master", info
    assert info["spend"] == 0.0 and info["max_budget"] is None, info
    assert nobody.status_code == 401 and nobody.json()["error"]["code"] == "invalid_api_key", nobody.text


def test_team_info_and_list_answer_litellms_shape_for_the_configs_teams(tmp_path):
    """LiteLLM's /team/info and /team/list were route 404s: a LiteLLM user's script reading a
    team's limits, spend and keys failed. The master key reads any team; a key its own."""

    async def calls(c):
        key = (
            await c.post("/key/generate", json={"team_id": "red", "key_alias": "r1"}, headers=MASTER)
        ).json()
        lone = (await c.post("/key/generate", json={}, headers=MASTER)).json()["key"]
        mine = {"Authorization": f"Bearer {key['key']}"}
        return (
            await c.get("/team/info", params={"team_id": "red"}, headers=MASTER),
            await c.get("/team/info", headers=mine),
            await c.get("/team/info", params={"team_id": "green"}, headers=MASTER),
            await c.get("/team/info", params={"team_id": "blue"}, headers=mine),
            await c.get("/team/info", headers={"Authorization": f"Bearer {lone}"}),
            await c.get("/team/list", headers=MASTER),
            await c.get("/team/list", headers=mine),
            key["token"],
        )

    red, own, missing, others, teamless, listed, not_admin, token = _run(tmp_path, calls)
    assert red.status_code == 200, red.text
    info = red.json()["team_info"]
    assert red.json()["team_id"] == "red" and info["rpm_limit"] == 10 and info["spend"] == 0.0, info
    assert info["max_budget"] is None and info["models"] == [], info
    assert [k["token"] for k in red.json()["keys"]] == [token], red.json()["keys"]
    assert own.status_code == 200 and own.json() == red.json(), own.text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "team_not_found", missing.text
    assert others.status_code == 401 and teamless.status_code == 404, (others.text, teamless.text)
    assert listed.status_code == 200 and [t["team_id"] for t in listed.json()] == ["red", "blue"], listed.text
    assert not_admin.status_code == 401, not_admin.text


@pytest.mark.parametrize("path", ["/key/generate", "/key/update", "/key/delete"])
def test_the_litellm_key_paths_need_the_master_key(tmp_path, path):
    async def calls(c):
        return (await c.post(path, json={}, headers={"Authorization": "Bearer sk-nobody"})).status_code

    assert _run(tmp_path, calls) == 401


def test_model_info_lists_the_deployments_a_key_may_call_in_litellms_shape(tmp_path):
    """GET /model/info (LiteLLM's; its UI and users' scripts read context sizes and prices there)
    was a route 404. Now each deployment the key may call, without the backend's URL or key."""

    async def calls(c):
        key = (await c.post("/key/generate", json={"models": ["b"]}, headers=MASTER)).json()["key"]
        mine = await c.get("/model/info", headers={"Authorization": f"Bearer {key}"})
        every = await c.get("/v1/model/info", headers=MASTER)
        one = await c.get("/model/info", params={"litellm_model_id": "a-0"}, headers=MASTER)
        hidden = await c.get(
            "/model/info", params={"litellm_model_id": "a-0"}, headers={"Authorization": f"Bearer {key}"}
        )
        anonymous = await c.get("/model/info")
        return mine, every, one, hidden, anonymous

    mine, every, one, hidden, anonymous = _run(tmp_path, calls)
    assert mine.status_code == 200 and [r["model_name"] for r in mine.json()["data"]] == ["b"], mine.text
    row = mine.json()["data"][0]
    assert row["litellm_params"] == {"model": "x"} and row["model_info"]["id"] == "b-1", row
    assert "sk-backend-secret" not in every.text and "127.0.0.1" not in every.text
    assert [r["model_name"] for r in every.json()["data"]] == ["a", "b"]
    assert [r["model_info"]["id"] for r in one.json()["data"]] == ["a-0"]
    assert hidden.status_code == 404 and anonymous.status_code == 401


def test_a_blocked_key_is_refused_with_litellms_message_until_unblocked(tmp_path):
    """LiteLLM's /key/block and /key/unblock were route 404s: stopping a leaked key meant
    deleting it (its limits and spend with it)."""

    async def calls(c):
        body = {"key_alias": "app", "rpm_limit": 9}
        made = (await c.post("/key/generate", json=body, headers=MASTER)).json()
        own = {"Authorization": f"Bearer {made['key']}"}
        blocked = await c.post("/key/block", json={"key": made["key"]}, headers=MASTER)
        refused = await _models(c, made["key"])
        info = await c.get("/key/info", params={"key": made["token"]}, headers=MASTER)
        unblocked = await c.post("/key/unblock", json={"key": made["token"]}, headers=MASTER)
        again = await _models(c, made["key"])
        by_update = await c.post("/key/update", json={"key": made["key"], "blocked": True}, headers=MASTER)
        refused_too = await _models(c, made["key"])
        odd = [
            await c.post("/key/block", json={"key": "sk-unknown"}, headers=MASTER),
            await c.post("/key/block", json={"key": "sk-master"}, headers=MASTER),
            await c.post("/key/block", json={"key": made["key"], "x": 1}, headers=MASTER),
            await c.post("/key/block", json={"key": made["key"]}, headers=own),
        ]
        return blocked, refused, info, unblocked, again, by_update, refused_too, odd

    blocked, refused, info, unblocked, again, by_update, refused_too, odd = _run(tmp_path, calls)
    assert blocked.status_code == 200 and blocked.json()["blocked"] is True, blocked.text
    assert blocked.json()["key_alias"] == "app" and blocked.json()["rpm_limit"] == 9, blocked.text
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["message"] == (
        "Authentication Error, Key is blocked. Update via `/key/unblock` if you're an admin."
    )
    assert info.json()["info"]["blocked"] is True, info.text
    assert unblocked.status_code == 200 and unblocked.json()["blocked"] is False, unblocked.text
    assert again.status_code == 200, again.text
    assert by_update.status_code == 200 and by_update.json()["blocked"] is True, by_update.text
    assert refused_too.status_code == 401, refused_too.text
    assert [r.status_code for r in odd] == [404, 400, 400, 401], [r.text for r in odd]


def test_spend_logs_and_global_spend_answer_in_litellms_shapes(tmp_path):
    """LiteLLM's GET /spend/logs and /global/spend were route 404s: a LiteLLM user's spend
    scripts and dashboards read nothing. So were /global/spend/keys and /global/spend/models (the
    top spenders), and user_id= was a 400 (the gateway had no users)."""
    day = datetime.datetime(2026, 3, 1, 12, tzinfo=datetime.UTC).timestamp()
    k1, k2 = hashlib.sha256(b"sk-one").hexdigest(), hashlib.sha256(b"sk-two").hexdigest()
    rows = [
        SpendRow(day, "r1", k1, "one", "red", "a", "a-0", 10, 5, 0.25, 200),
        SpendRow(day + 60, "r2", k2, None, None, "b", "b-1", 4, 0, 0.5, 502, "ann"),
        SpendRow(day + 86400, "r3", k1, "one", "red", "b", "b-1", 1, 1, 1.0, 200),
    ]

    async def calls(c):
        get = lambda path, **q: c.get(path, params=q, headers=MASTER)  # noqa: E731
        return (
            await get("/spend/logs"),
            await get("/spend/logs", api_key="sk-one"),
            await get("/spend/logs", request_id="r2"),
            await get("/spend/logs", start_date="2026-03-01", end_date="2026-03-03"),
            await get("/spend/logs", start_date="2026-03-02", end_date="2026-03-02", summarize="false"),
            await get("/global/spend"),
            [await get("/spend/logs", user_id="ann"), await get("/global/spend/keys", limit=1),
             await get("/global/spend/models")],
            [await get("/spend/logs", start_date="2026-03-01"),
             await get("/spend/logs", start_date="3/1", end_date="2026-03-02"),
             await c.get("/global/spend", headers={"Authorization": "Bearer sk-nobody"})],
        )  # fmt: skip

    every, mine, one, summary, day2, total, (by_user, top_keys, top_models), refused = _run(
        tmp_path, calls, rows
    )
    assert every.status_code == 200, every.text
    assert [r["request_id"] for r in every.json()] == ["r3", "r2", "r1"]  # newest first
    r1 = every.json()[2]
    assert r1 == {
        "request_id": "r1", "api_key": k1, "spend": 0.25, "total_tokens": 15, "prompt_tokens": 10,
        "completion_tokens": 5, "startTime": "2026-03-01T12:00:00+00:00",
        "endTime": "2026-03-01T12:00:00+00:00", "model": "x", "model_group": "a", "model_id": "a-0",
        "team_id": "red", "user": "", "status": "success",
        "metadata": {"user_api_key_alias": "one", "status": "success", "status_code": 200},
    }, r1  # fmt: skip
    assert every.json()[1]["status"] == "failure"
    assert [r["request_id"] for r in mine.json()] == ["r3", "r1"] and [
        r["request_id"] for r in one.json()
    ] == ["r2"]
    assert summary.json() == [
        {k1: 0.25, k2: 0.5, "startTime": "2026-03-01", "spend": 0.75, "users": {"ann": 0.5},
         "models": {"a": 0.25, "b": 0.5}},
        {k1: 1.0, "startTime": "2026-03-02", "spend": 1.0, "users": {}, "models": {"b": 1.0}},
        {"startTime": "2026-03-03", "spend": 0, "users": {}, "models": {}},
    ], summary.text  # fmt: skip
    assert [r["request_id"] for r in day2.json()] == ["r3"], day2.text  # (both days included)
    assert total.json() == {"spend": 1.75, "max_budget": None}, total.text
    assert [(r["request_id"], r["user"]) for r in by_user.json()] == [("r2", "ann")], by_user.text
    assert top_keys.json() == [{"api_key": k1, "total_spend": 1.25, "key_alias": None, "key_name": None}]
    assert top_models.json() == [{"model": "b", "total_spend": 1.5}, {"model": "a", "total_spend": 0.25}]
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [
        (400, "end_date"),
        (400, "start_date"),
        (401, None),
    ], [r.text for r in refused]


def test_a_regenerated_key_replaces_the_old_one_and_keeps_its_budget_and_spend(tmp_path):
    """LiteLLM's /key/regenerate was a route 404. The new key goes on with the old one's
    limits, budget and spend (LiteLLM rotates the token in place); the old one is refused."""

    async def calls(c, app):
        keys = app.state.gateway.keys
        _, rec = await keys.create_async(KeySpec(alias="app", max_budget=3.0, rpm=7))
        old = rec.key_hash
        app.state.gateway.spend.record(
            SpendRow(time.time(), "r1", old, "app", None, "a", "a-0", 1, 1, 1.25, 200)
        )
        made = await c.post("/key/regenerate", json={"key": old, "rpm_limit": 8}, headers=MASTER)
        again = await c.post(f"/key/{made.json()['key']}/regenerate", headers=MASTER)
        new = again.json()["key"]
        return (
            made,
            again,
            await c.get("/key/info", params={"key": old}, headers=MASTER),
            await _models(c, made.json()["key"]),
            await _models(c, new),
            await c.get("/spend/logs", params={"api_key": new}, headers=MASTER),
            (await c.get("/key/list", headers=MASTER)).json()["keys"],
            (await keys.find(new)).scope == rec.scope,  # (the same budget and rate windows in the store)
            [await c.post("/key/regenerate", json={"key": old}, headers=MASTER),
             await c.post("/key/regenerate", json={"key": new, "new_key": "sk-mine"}, headers=MASTER),
             await c.post("/key/regenerate", json={"key": new}, headers={"Authorization": f"Bearer {new}"})],
        )  # fmt: skip

    made, again, old_info, old_use, new_use, logs, listed, same_scope, refused = _run(
        tmp_path, calls, app=True
    )
    assert made.status_code == 200, made.text
    m = made.json()
    assert len(m["token"]) == 64 and m["key_alias"] == "app" and same_scope, m
    assert (m["max_budget"], m["rpm_limit"], m["spend"]) == (3.0, 8, 1.25), (
        m
    )  # (rpm_limit changed on the way)
    assert again.status_code == 200 and again.json()["spend"] == 1.25 and again.json()["rpm_limit"] == 8
    assert old_info.status_code == 404 and old_use.status_code == 401 and new_use.status_code == 200
    assert [r["request_id"] for r in logs.json()] == ["r1"], logs.text
    assert listed == [again.json()["token"]], listed
    assert [r.status_code for r in refused] == [404, 400, 401], [r.text for r in refused]


def test_key_and_team_spend_are_the_budget_periods_as_litellm_shows_them(tmp_path):
    """/key/info and /team/info showed the whole log's spend: a key with a daily budget read as
    spent far past its max_budget while it was admitted. LiteLLM sets spend back to 0 at each
    budget_duration reset and says when (budget_reset_at)."""
    now = time.time()
    midnight = datetime.datetime.fromtimestamp(now, datetime.UTC).replace(
        hour=0, minute=0, second=0, microsecond=0
    )

    async def calls(c, app):
        body = {"max_budget": 5.0, "budget_duration": "1d", "team_id": "red"}
        daily = (await c.post("/key/generate", json=body, headers=MASTER)).json()
        whole = (await c.post("/key/generate", json={"max_budget": 5.0}, headers=MASTER)).json()
        for key in (daily, whole):  # 4.0 two days ago, 1.5 now (every row counted as team red's)
            for ts, cost in ((now - 2 * 86400, 4.0), (now, 1.5)):
                app.state.gateway.spend.record(
                    SpendRow(ts, "r", key["token"], None, "red", "a", "a-0", 1, 1, cost, 200)
                )
        info = lambda k: c.get("/key/info", params={"key": k}, headers=MASTER)  # noqa: E731
        team = await c.get("/team/info", params={"team_id": "red"}, headers=MASTER)
        return (
            (await info(daily["key"])).json()["info"],
            (await info(whole["key"])).json()["info"],
            team.json(),
        )

    daily, whole, team = _run(tmp_path, calls, app=True)
    reset = (midnight + datetime.timedelta(days=1)).isoformat()
    assert daily["spend"] == 1.5 and daily["budget_reset_at"] == reset, daily
    assert whole["spend"] == 5.5 and whole["budget_reset_at"] is None, (
        whole
    )  # (no budget_duration: all of it)
    assert team["team_info"]["spend"] == 11.0 and team["team_info"]["budget_reset_at"] is None, team
    assert [k["spend"] for k in team["keys"]] == [1.5], team["keys"]


def test_key_list_pages_and_filters_as_litellms(tmp_path):
    """/key/list ignored LiteLLM's page, size and filters: every page was all the keys (a script
    reading pages until an empty one never ended) and ?team_id= answered every team's keys."""

    async def calls(c):
        made = [(await c.post("/key/generate", json={}, headers=MASTER)).json()["token"] for _ in range(11)]
        red = (await c.post("/key/generate", json={"team_id": "red"}, headers=MASTER)).json()["token"]
        await c.post("/key/block", json={"key": made[0]}, headers=MASTER)
        get = lambda **q: c.get("/key/list", params=q, headers=MASTER)  # noqa: E731
        pages = [(await get(page=p)).json() for p in (1, 2, 3)]
        return (
            made + [red],
            pages,
            [
                (await get(team_id="red")).json()["keys"],
                (await get(status="revoked")).json()["keys"],
                (await get(key_hash=red, size=100)).json()["keys"],
                (await get(status="active", size=5, page=3)).json(),
            ],
            [await get(organization_id="o"), await get(size=101), await get(status="gone")],
        )

    tokens, pages, filtered, refused = _run(tmp_path, calls)
    assert [p["keys"] for p in pages] == [tokens[:10], tokens[10:], []], pages
    assert {(p["total_count"], p["total_pages"]) for p in pages} == {(12, 2)} and pages[1][
        "current_page"
    ] == 2
    assert filtered[:3] == [[tokens[-1]], [tokens[0]], [tokens[-1]]], filtered
    assert filtered[3] == {"keys": [tokens[-1]], "total_count": 11, "current_page": 3, "total_pages": 3}
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [
        (400, "organization_id"), (400, "size"), (400, "status")
    ], [r.text for r in refused]  # fmt: skip


def test_a_key_alias_is_one_live_keys_as_litellm_requires(tmp_path):
    """Two keys could share a key_alias: a script making its key "if missing" by alias made
    another each run, and /key/delete by alias took every one."""

    async def calls(c):
        first = (await c.post("/key/generate", json={"key_alias": "app"}, headers=MASTER)).json()
        other = (await c.post("/key/generate", json={"key_alias": "web"}, headers=MASTER)).json()
        return (
            await c.post("/key/generate", json={"key_alias": "app"}, headers=MASTER),
            await c.post("/key/update", json={"key": other["key"], "key_alias": "app"}, headers=MASTER),
            await c.post(
                "/key/update", json={"key": first["key"], "key_alias": "app", "rpm_limit": 3}, headers=MASTER
            ),
            await c.post("/key/regenerate", json={"key": first["key"]}, headers=MASTER),
            await c.post("/key/delete", json={"key_aliases": ["app"]}, headers=MASTER),
            await c.post("/key/generate", json={"key_alias": "app"}, headers=MASTER),
        )

    twice, renamed, same, regenerated, deleted, again = _run(tmp_path, calls)
    for r in (twice, renamed):
        assert r.status_code == 400 and r.json()["error"]["param"] == "key_alias", r.text
        assert "Key with alias 'app' already exists." in r.json()["error"]["message"], r.text
    assert same.status_code == 200 and regenerated.status_code == 200, (same.text, regenerated.text)
    assert deleted.json() == {"deleted_keys": ["app"]} and again.status_code == 200, (
        deleted.text,
        again.text,
    )


def test_litellms_user_paths_make_read_change_and_delete_a_user_and_its_keys(tmp_path):
    """/user/new, /user/info, /user/list, /user/update and /user/delete were route 404s: a LiteLLM proxy
    user's onboarding script failed at its first call. A user owns keys (its auto-created one,
    /key/generate's user_id) and is deleted with them."""

    async def calls(c):
        body = {"user_id": "ann", "user_email": "ann@example.com", "max_budget": 3.0,
                "budget_duration": "30d", "rpm_limit": 9, "models": ["a"], "user_role": "internal_user",
                "key_alias": "ann-laptop"}  # fmt: skip
        made = await c.post("/user/new", json=body, headers=MASTER)
        assert made.status_code == 200, made.text
        m = made.json()
        assert m["user_id"] == "ann" and m["key"].startswith("sk-") and m["key_alias"] == "ann-laptop", m
        assert (m["max_budget"], m["rpm_limit"], m["models"], m["spend"]) == (3.0, 9, ["a"], 0.0), m
        again = await c.post("/user/new", json={"user_id": "ann"}, headers=MASTER)
        assert again.status_code == 409 and again.json()["error"]["param"] == "user_id", again.text
        twin = await c.post("/user/new", json={"user_email": "ANN@example.com"}, headers=MASTER)
        assert twin.status_code == 409 and twin.json()["error"]["param"] == "user_email", twin.text
        bare = await c.post(
            "/user/new", json={"auto_create_key": False, "user_role": "customer"}, headers=MASTER
        )
        assert bare.json()["user_role"] == "customer", bare.text
        assert bare.json()["key"] is None and len(bare.json()["user_id"]) == 36, bare.text  # (a uuid)
        wrong = await c.post("/user/new", json={"teams": ["red"]}, headers=MASTER)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "teams", wrong.text
        admin = await c.post("/user/new", json={"user_role": "proxy_admin"}, headers=MASTER)
        assert admin.status_code == 400 and admin.json()["error"]["param"] == "user_role", admin.text
        # text that cannot be stored: a 400, not a 500
        json_h = {**MASTER, "content-type": "application/json"}
        odd_fields = (("/user/new", "user_id"), ("/user/new", "user_email"), ("/key/generate", "user_id"))
        for path, field in odd_fields:
            odd = await c.post(path, content='{"' + field + '": "\\ud800"}', headers=json_h)
            assert odd.status_code == 400 and odd.json()["error"]["param"] == field, odd.text
        # a second key of hers; a user_id naming no user makes one (LiteLLM's upsert)
        second = (await c.post("/key/generate", json={"user_id": "ann"}, headers=MASTER)).json()
        assert second["user_id"] == "ann", second
        bob = await c.post("/key/generate", json={"user_id": "bob"}, headers=MASTER)
        assert bob.status_code == 200 and bob.json()["user_id"] == "bob", bob.text
        dave = await c.post("/admin/keys", json={"user": "dave"}, headers=MASTER)  # (the gateway's own API)
        assert dave.status_code == 200 and dave.json()["user"] == "dave", dave.text
        dave_info = (await c.get("/user/info", params={"user_id": "dave"}, headers=MASTER)).json()
        assert [k["token"] for k in dave_info["keys"]] == [dave.json()["key_hash"]], dave_info
        # her models cap her keys: "b" is not hers
        assert [x["id"] for x in (await _models(c, second["key"])).json()["data"]] == ["a"]
        info = await c.get("/user/info", params={"user_id": "ann"}, headers=MASTER)
        i = info.json()
        assert info.status_code == 200 and i["user_info"]["user_email"] == "ann@example.com", info.text
        assert sorted(k["token"] for k in i["keys"]) == sorted([m["token"], second["token"]]), i
        own = await c.get("/user/info", headers={"Authorization": f"Bearer {second['key']}"})
        assert own.status_code == 200 and own.json()["user_id"] == "ann", own.text
        other = await c.get("/user/info", params={"user_id": "bob"},
                            headers={"Authorization": f"Bearer {second['key']}"})  # fmt: skip
        assert other.status_code == 401, other.text
        listed = await c.get("/key/list", params={"user_id": "ann"}, headers=MASTER)
        assert sorted(listed.json()["keys"]) == sorted([m["token"], second["token"]]), listed.text
        users = (await c.get("/user/list", params={"page_size": 2}, headers=MASTER)).json()
        assert [u["user_id"] for u in users["users"]] == ["dave", "bob"], users  # newest first
        assert (users["total"], users["total_pages"], users["users"][0]["key_count"]) == (4, 2, 1), users
        ann = (await c.get("/user/list", params={"user_ids": "ann,nobody"}, headers=MASTER)).json()
        assert [(u["user_id"], u["key_count"]) for u in ann["users"]] == [("ann", 2)], ann
        up = await c.post("/user/update", json={"user_id": "ann", "max_budget": 5.0, "models": None},
                          headers=MASTER)  # fmt: skip
        assert up.status_code == 200 and up.json()["data"]["max_budget"] == 5.0, up.text
        assert up.json()["data"]["models"] == ["a"] and up.json()["data"]["rpm_limit"] == 9, up.text
        gone = await c.post("/user/update", json={"user_id": "nobody", "max_budget": 1}, headers=MASTER)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "user_not_found", gone.text
        partly = await c.post("/user/delete", json={"user_ids": ["ann", "nobody"]}, headers=MASTER)
        assert partly.status_code == 404, partly.text  # none deleted
        assert (await _models(c, second["key"])).status_code == 200
        deleted = await c.post("/user/delete", json={"user_ids": ["ann"]}, headers=MASTER)
        assert deleted.status_code == 200 and deleted.json()["deleted_users"] == ["ann"], deleted.text
        assert (await _models(c, second["key"])).status_code == 401  # her keys went with her
        assert (await _models(c, m["key"])).status_code == 401
        assert (await c.get("/user/info", params={"user_id": "ann"}, headers=MASTER)).status_code == 404
        return True

    assert _run(tmp_path, calls)


def test_litellms_month_week_and_word_durations_are_taken(tmp_path):
    """LiteLLM's docs write budget_duration "1mo" (and "1w", "monthly") and duration "1w": each
    was a 400 here. "1mo" is a calendar month (reset on the 1st, as LiteLLM's); "2mo" has no such
    period here and stays a 400 rather than counting 60-day windows from 1970."""

    async def calls(c):
        body = {"budget_duration": "1mo", "duration": "1w", "max_budget": 1.0}
        return (
            await c.post("/key/generate", json=body, headers=MASTER),
            await c.post("/user/new", json={"budget_duration": "weekly", "max_budget": 1.0}, headers=MASTER),
            await c.post("/key/generate", json={"budget_duration": "2mo"}, headers=MASTER),
        )

    month, weekly, two = _run(tmp_path, calls)
    assert month.status_code == 200, month.text
    now = datetime.datetime.now(datetime.UTC)
    first = datetime.datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=datetime.UTC)
    assert datetime.datetime.fromisoformat(month.json()["budget_reset_at"]) == first, month.text
    expires = datetime.datetime.fromisoformat(month.json()["expires"])
    assert abs((expires - now).total_seconds() - 7 * 86400) < 60, month.text
    assert weekly.status_code == 200 and weekly.json()["budget_duration"] == "weekly", weekly.text
    monday = datetime.datetime.fromisoformat(weekly.json()["budget_reset_at"])
    assert monday.weekday() == 0 and (monday.hour, monday.minute) == (0, 0), weekly.text
    assert two.status_code == 400 and two.json()["error"]["param"] == "budget_duration", two.text


def test_a_spend_log_written_before_users_gains_their_column_and_keeps_its_rows(tmp_path):
    """The spend log's rows record their key's user (a user's budget is rebuilt from them): a
    log an earlier version wrote is given the column, its rows read as no user's."""
    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("CREATE TABLE spend (ts REAL, request_id TEXT, key_hash TEXT, key_alias TEXT, team TEXT,"
               " model TEXT, deployment TEXT, prompt_tokens INTEGER, completion_tokens INTEGER, cost REAL,"
               " status INTEGER)")  # fmt: skip
    db.execute("INSERT INTO spend VALUES (1.0, 'r1', 'h', NULL, NULL, 'a', 'a-0', 1, 1, 0.5, 200)")
    db.commit()
    log = SpendLog(open_database(str(tmp_path / "old.db")))
    SpendLog(open_database(str(tmp_path / "old.db")))  # (a second instance: the column is there)
    log.record(SpendRow(2.0, "r2", "h", None, None, "a", "a-0", 1, 1, 0.25, 200, "ann"))

    async def read():
        return await log.entries(None, None, 0.0, 1e18, 10), await log.spent(0.0, user="ann")

    rows, ann = asyncio.run(read())
    assert [(r.request_id, r.user) for r in rows] == [("r2", "ann"), ("r1", None)] and ann == 0.25


def test_a_keys_duration_in_months_is_calendar_months_as_litellms(tmp_path, monkeypatch):
    """A key's `duration: "1mo"` was 30 days (made on 31 January, it died on 2 March), while a
    budget's "1mo" is a calendar month; and "2mo" was a 400. LiteLLM's key duration is N calendar
    months: the same day and time, the month's last day when it is shorter."""
    made_at = datetime.datetime(2027, 1, 31, 12, 0, tzinfo=datetime.UTC).timestamp()
    monkeypatch.setattr("kvserve.gateway.litellm_keys.time.time", lambda: made_at)

    async def calls(c):
        out = []
        for duration in ("1mo", "2mo", "12mo", "0mo"):
            r = await c.post("/key/generate", json={"duration": duration}, headers=MASTER)
            ok = r.status_code == 200
            out.append(r.json()["expires"] if ok else (r.status_code, r.json()["error"]["param"]))
        return out

    assert _run(tmp_path, calls) == [
        "2027-02-28T12:00:00+00:00",
        "2027-03-31T12:00:00+00:00",
        "2028-01-31T12:00:00+00:00",
        (400, "duration"),
    ]
