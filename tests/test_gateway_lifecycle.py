"""The gateway's lifecycle matches the server's: /health (liveness), /health/ready (readiness,
false while draining), and SIGTERM drains: new requests get 503 + Retry-After, the one in
flight still gets its answer, then the process exits 0. Against the fault backend (no model)."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
from gateway_utils import FaultBackend, GatewayProcess, deployment
from stream_endings import assert_drained_at_deadline

KEY = "sk-life"
BODY = {"model": "held", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 2}
AUTH = {"Authorization": f"Bearer {KEY}"}


def _until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_sigterm_drains_the_gateway(tmp_path):
    fault, gw = FaultBackend(), None  # (a gateway that does not start must not leave the backend)
    cfg = {
        "model_list": [deployment("held", fault.url + "/v1", "hold-2")],
        "keys": [{"key": KEY}],
        "general_settings": {"database": str(tmp_path / "gw.db"), "shutdown_timeout": 60},
    }
    try:
        gw = GatewayProcess(cfg, str(tmp_path))
        assert httpx.get(gw.url + "/health").status_code == 200
        ready = httpx.get(gw.url + "/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "healthy", ready.text
        assert ready.json()["ready"] is True and ready.json()["db"] == "connected", ready.text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post, gw.url + "/v1/chat/completions", json=BODY, headers=AUTH, timeout=60
            )
            _until(lambda: fault.count("hold-2") == 1)
            gw.proc.send_signal(signal.SIGTERM)
            _until(lambda: httpx.get(gw.url + "/health/ready").status_code == 503)
            draining = httpx.get(gw.url + "/health/ready").json()
            assert draining["reason"] == "draining" and draining["status"] == "unhealthy", draining
            assert draining["deployments"] == [], draining  # (the dashboard's table reads it)
            assert httpx.get(gw.url + "/health").status_code == 200  # alive while draining
            refused = httpx.post(gw.url + "/v1/chat/completions", json=BODY, headers=AUTH)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["code"] == "shutting_down"
            answer = held.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == " tok tok"
        assert gw.proc.wait(30) == 0
        assert fault.count("hold-2") == 1  # the refused request never reached the backend
        assert "Traceback" not in gw.logs(), gw.logs()
    finally:
        if gw is not None:
            gw.stop()
        fault.stop()


def test_the_drain_deadline_ends_what_is_still_in_flight(tmp_path):
    """At shutdown_timeout the drain only stopped waiting: uvicorn then waited for every
    stream and request still running, however long (a pod outlived its timeout until killed,
    its streams cut with no word). Now, as kvserve serve: a stream still running gets an error
    event (shutting_down) and [DONE], a request still waiting a 503 + Retry-After; then it exits."""
    fault, gw = FaultBackend(), None
    cfg = {
        "model_list": [
            deployment("slow", fault.url + "/v1", "slow"),
            deployment("held", fault.url + "/v1", "hold-60"),
        ],
        "keys": [{"key": KEY}],
        "general_settings": {"database": str(tmp_path / "gw.db"), "shutdown_timeout": 1},
    }

    def stream() -> list[str]:
        body = {"model": "slow", "messages": BODY["messages"], "max_tokens": 600, "stream": True}  # ~60 s
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    try:
        gw = GatewayProcess(cfg, str(tmp_path))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream)
            held = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json={**BODY, "model": "held"},
                               headers=AUTH, timeout=60)  # fmt: skip
            _until(lambda: fault.count("hold-60") == 1 and fault.count("slow") == 1)
            gw.proc.send_signal(signal.SIGTERM)
            events, answer = streamed.result(), held.result()
        assert_drained_at_deadline(events, answer, "shutting down")
        assert gw.proc.wait(30) == 0
        assert "Traceback" not in gw.logs(), gw.logs()
    finally:
        if gw is not None:
            gw.stop()
        fault.stop()


def _ready_in_process(
    cfg: dict, tmp_path, path: str = "/health/ready", headers: dict | None = None
) -> tuple[httpx.Response, float]:
    """GET `path` (/health/ready) of an in-process gateway, and how long it took."""
    import asyncio

    from kvserve.gateway.app import build_app
    from kvserve.gateway.config import parse_config

    gs = {**cfg.get("general_settings", {}), "database": str(tmp_path / "gw.db")}
    cfg = {**cfg, "general_settings": gs}
    app = build_app(parse_config(cfg), web_ui=False)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            t0 = time.monotonic()
            r = await c.get(path, headers=headers, timeout=30)
            return r, time.monotonic() - t0

    return asyncio.run(go())


def test_readiness_answers_within_a_probes_timeout_when_a_dependency_hangs(tmp_path):
    """Kubernetes' probe gives up after 1 s (timeoutSeconds' default) and counts it as not ready.
    One hung backend out of two kept /health/ready waiting 2 s, so every gateway replica went
    unready while the other backend served; a hung Redis kept it 5 s and answered an error body."""
    import socket

    from gateway_utils import RedisServer

    fault, redis_server = FaultBackend(), RedisServer()
    hung = socket.socket()  # accepts connections (the backlog) and never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}/v1"
    deps = [deployment("m", fault.url + "/v1", "ok"), deployment("m", hung_url, "ok")]
    try:
        resp, took = _ready_in_process({"model_list": deps}, tmp_path)
        assert resp.status_code == 200, resp.text
        assert [d["up"] for d in resp.json()["deployments"]] == [True, False]
        # LiteLLM's readiness fields, which its users' probes parse (was "status": "ready")
        assert resp.json()["status"] == "healthy" and resp.json()["db"] == "connected", resp.text
        assert took < 1.9, took  # (the hung probe's own timeout is 2 s)

        redis_server.proc.send_signal(signal.SIGSTOP)
        cfg = {"model_list": deps, "general_settings": {"state": redis_server.url}}
        resp, took = _ready_in_process(cfg, tmp_path)
        assert resp.status_code == 503, resp.text
        assert resp.json()["status"] == "unhealthy" and resp.json()["state_store"] is False, resp.text
        assert resp.json()["db"] == "disconnected" and resp.json()["ready"] is False, resp.text
        assert took < 3, took  # (Redis's socket timeout is 5 s)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
        redis_server.stop()
        hung.close()
        fault.stop()


def test_health_with_a_key_lists_the_keys_deployments_as_litellm_does(tmp_path):
    """LiteLLM's /health (key required) answers healthy_endpoints / unhealthy_endpoints; its users'
    monitors got {"status": "ok"} here with a backend down. Without a key it stays liveness."""
    from server_utils import free_port

    fault = FaultBackend()
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    cfg = {
        "model_list": [deployment("m", fault.url + "/v1", "ok"), deployment("m", dead, "ok"),
                       deployment("n", fault.url + "/v1", "ok")],
        "keys": [{"key": "sk-narrow", "models": ["m"]}],
        "general_settings": {"master_key": "sk-master"},
    }  # fmt: skip

    def get(key: str | None, query: str = "") -> httpx.Response:
        head = {"Authorization": f"Bearer {key}"} if key else None
        return _ready_in_process(cfg, tmp_path, "/health" + query, head)[0]

    try:
        assert get(None).json() == {"status": "ok"}  # probes send no key
        r = get("sk-narrow").json()
        assert (r["healthy_count"], r["unhealthy_count"]) == (1, 1), r
        assert [e["model_id"] for e in r["healthy_endpoints"]] == ["m-0"], r
        bad = r["unhealthy_endpoints"][0]
        assert bad["model_id"] == "m-1" and "GET /models" in bad["error"] and "api_base" not in bad, r
        r = get("sk-master").json()  # every deployment, with its URL (the operator's)
        assert sorted(e["model_id"] for e in r["healthy_endpoints"]) == ["m-0", "n-2"], r
        assert r["unhealthy_endpoints"][0]["api_base"] == dead, r
        assert get("sk-master", "?model=n").json()["healthy_count"] == 1
        assert get("sk-narrow", "?model=n").status_code == 404  # not its model: not said to exist
        assert get("sk-wrong").status_code == 401
    finally:
        fault.stop()


def test_counted_requests_use_every_connection_and_readiness_sees_past_a_full_pool(tmp_path):
    """A deployment's max_connections (8 here: two clients of 4, taken in turn) held only 4
    requests at once for a key whose prompt tokens are counted: the /tokenize call took a turn
    too, so every request landed on the same client. And with the pool full, the readiness
    probe waited behind the requests and read the busy deployment as down (503)."""
    fault, gw = FaultBackend(), None
    cfg = {
        "model_list": [deployment("held", fault.url + "/v1", "hold-5", max_connections=8)],
        "keys": [{"key": KEY}, {"key": "sk-counted", "tpm": 10**6}],  # tpm: prompt tokens counted
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }

    def eight(key: str, arrived: int) -> None:
        """8 requests at once; all 8 reach the backend (each is held 5 s); readiness meanwhile."""
        url, auth = gw.url + "/v1/chat/completions", {"Authorization": f"Bearer {key}"}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            held = [pool.submit(httpx.post, url, json=BODY, headers=auth, timeout=60) for _ in range(8)]
            _until(lambda: fault.count("hold-5") == arrived, timeout=4.5)
            ready = httpx.get(gw.url + "/health/ready", timeout=10)
            assert ready.status_code == 200 and ready.json()["deployments"][0]["up"], ready.text
            assert all(h.result().status_code == 200 for h in held)

    try:
        gw = GatewayProcess(cfg, str(tmp_path))
        eight("sk-counted", 8)
        eight(KEY, 16)
    finally:
        if gw is not None:
            gw.stop()
        fault.stop()


def test_a_pd_deployments_decodes_use_every_connection(tmp_path):
    """A pd deployment's prefill and decode calls took turns of the same client shards, so each
    request took two: with two shards every decode landed on one, and max_connections 8 ran 4
    decodes at once, the others waiting in the gateway."""
    fault, gw = FaultBackend(), None
    dep = deployment(
        "held", fault.url + "/v1", "decode-hold-8", max_connections=8, prefill_url=fault.url + "/v1"
    )
    cfg = {
        "model_list": [dep],
        "keys": [{"key": KEY}],
        "general_settings": {"database": str(tmp_path / "gw.db")},
    }
    try:
        gw = GatewayProcess(cfg, str(tmp_path))
        url = gw.url + "/v1/chat/completions"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            held = []
            for _ in range(8):  # one after another: each prefill answers at once, its decode is held 8 s
                held.append(pool.submit(httpx.post, url, json=BODY, headers=AUTH, timeout=60))
                time.sleep(0.3)
            _until(lambda: fault.count("decode-hold-8") == 16, timeout=5)  # 8 prefills, 8 decodes
            assert all(h.result().status_code == 200 for h in held)
    finally:
        if gw is not None:
            gw.stop()
        fault.stop()
