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
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post, gw.url + "/v1/chat/completions", json=BODY, headers=AUTH, timeout=60
            )
            _until(lambda: fault.count("hold-2") == 1)
            gw.proc.send_signal(signal.SIGTERM)
            _until(lambda: httpx.get(gw.url + "/health/ready").status_code == 503)
            assert httpx.get(gw.url + "/health/ready").json()["reason"] == "draining"
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
