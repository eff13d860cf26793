"""One kvserve replica inside Ray Serve: the replica actor starts `kvserve serve` on a free
local port and relays requests to it.

Why a subprocess and not kvserve's FastAPI app mounted with Serve's ASGI ingress:
- `kvserve serve` is already two processes (API + engine core over ZeroMQ) with its own
  supervisor, readiness after warm-up, SIGTERM drain and /metrics; inside an actor those
  would have to be re-plumbed (signals only reach a main thread, the core is a child of
  the API process, uvloop/uvicorn settings differ), and the Kubernetes image and this
  deployment would run different code paths. As a child process the server is the same
  binary everywhere and is tested once.
- The engine's threads and memory stay out of the actor process, so the actor stays
  responsive to Serve's health checks and queue-length probes while the model computes.
- Scale-down: Serve stops routing to the replica, waits for its ongoing requests
  (`graceful_shutdown_wait_loop_s` / `_timeout_s`, streams count until their last chunk),
  then calls `__del__`, which sends SIGTERM: the server's own drain then finds nothing in
  flight, stops its engine and removes its IPC files.
The price is one more localhost HTTP hop per request (not measured against a bare server yet).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from urllib.parse import quote

import httpx

from kvserve.deploy.ray_config import RayDeployConfig
from kvserve.routing.responses_ids import EventRewriter, encode_id, public_body, public_error

FORWARDED_HEADERS = ("authorization", "x-request-id", "x-session-id", "content-type")
# the server's answer headers the client needs too: how long to wait before trying again (a 503
# while the engine restarts or drains). Not x-request-id: Serve's proxy answers with its own
# request id, which it also hands the server (relayed, the header came twice)
RELAYED_HEADERS = ("retry-after",)
RESPONSES = "/v1/responses"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KVServeReplica:
    """A Serve deployment class (ray_serve.py wraps it with serve.deployment)."""

    def __init__(self, config: dict) -> None:
        self.cfg = RayDeployConfig.model_validate(config)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        if self.cfg.replica.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.cfg.replica.threads)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-replica-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", *self.cfg.server_argv(port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(self.cfg.replica.startup_timeout_s)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10))
        self.replica_id = _replica_id()

    def _wait_ready(self, timeout: float) -> None:
        """Until /health/ready (model loaded, one warm-up request served); a server that exits
        fails the constructor with its last log lines, which Serve reports."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self._stop(5)
        raise TimeoutError(f"kvserve serve not ready after {timeout:g} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    async def forward(
        self, path: str, body: dict, headers: dict[str, str], pin: str | None = None
    ) -> AsyncIterator:
        """Stream one POST through: first {status, content_type, replica, headers}, then the
        body's bytes as they arrive (SSE events for streams). Cancelled by Serve when the client leaves,
        which closes the connection, which aborts the request in the engine. A Responses
        answer's ids name this replica (routing/responses_ids.py); `pin` is the replica a
        previous_response_id names (the router sends it there while it runs)."""
        if pin is not None and pin != self.replica_id:  # that replica is gone, and its responses
            yield _gone_meta(self.replica_id)
            yield _gone(pin, body.get("previous_response_id"), "previous_response_id")
            return
        # (aclosing: a client leaving closes the POST now, which aborts the request in the engine)
        async with aclosing(
            self._responses(body, headers) if path == RESPONSES else self._post(path, body, headers)
        ) as parts:
            async for part in parts:
                yield part

    async def _responses(self, body: dict, headers: dict[str, str]) -> AsyncIterator:
        """A Responses answer with public ids: a stream event by event, a body whole."""
        async with aclosing(self._post(RESPONSES, body, headers)) as parts:
            meta = await anext(parts)
            yield meta
            if meta["status"] == 200 and meta["content_type"].startswith("text/event-stream"):
                ids = EventRewriter(self.replica_id)
                async for chunk in parts:
                    if out := ids.feed(chunk):
                        yield out
                if out := ids.flush():
                    yield out
                return
            content = b"".join([chunk async for chunk in parts])
        yield (public_body if meta["status"] == 200 else public_error)(content, self.replica_id, body)

    async def stored(
        self, method: str, own_id: str, query: str, headers: dict[str, str], pin: str, tail: str = ""
    ) -> tuple:
        """GET or DELETE /v1/responses/{id} (`tail` "/input_items": GET its input items; POST
        "/cancel") of a response this replica stored: (status, content type, body with public ids)."""
        if pin != self.replica_id:
            return 404, "application/json", _gone(pin, None, None)
        path = f"{RESPONSES}/{quote(own_id, safe='')}{tail}" + (f"?{query}" if query else "")
        resp = await self.client.request(method, path, headers=headers)
        if resp.status_code == 404:  # (the server's message names its own id, not the client's)
            msg = f"response {encode_id(self.replica_id, own_id)!r} not found (deleted, or no longer stored)"
            err = {"message": msg, "type": "invalid_request_error", "param": None, "code": "not_found"}
            return 404, "application/json", json.dumps({"error": err}).encode()
        content = public_body(resp.content, self.replica_id) if resp.status_code == 200 else resp.content
        return resp.status_code, resp.headers.get("content-type", "application/json"), content

    async def _post(self, path: str, body: dict, headers: dict[str, str]) -> AsyncIterator:
        # As the client sent them: JSON with escapes (httpx's json= encodes strict UTF-8 and
        # raised on a lone surrogate, valid JSON) and header values as their Latin-1 bytes (a str
        # is encoded as ASCII): either was an exception in the replica, a 500 for the client.
        content = json.dumps(body).encode()
        raw = {k: v.encode("latin-1") for k, v in headers.items() if k != "content-type"}
        raw["content-type"] = b"application/json"
        async with self.client.stream("POST", path, content=content, headers=raw) as resp:
            yield {
                "status": resp.status_code,
                "content_type": resp.headers.get("content-type", "application/json"),
                "replica": self.replica_id,
                "headers": {k: resp.headers[k] for k in RELAYED_HEADERS if k in resp.headers},
            }
            async for chunk in resp.aiter_raw():
                yield chunk

    async def get(self, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        resp = await self.client.get(path, headers=headers)
        return resp.status_code, resp.headers.get("content-type", "application/json"), resp.content

    async def check_health(self) -> None:
        """Serve's periodic probe: a dead server or a dead engine core (liveness /health) makes
        Serve replace this replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}")
        resp = await self.client.get("/health", timeout=10)
        if resp.status_code != 200:
            raise RuntimeError(f"kvserve serve /health answered {resp.status_code}")

    def _stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server's drain
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __del__(self) -> None:
        """Serve calls this after its own drain (no requests left); the server drains again
        (a no-op then) and exits."""
        proc = getattr(self, "proc", None)
        if proc is not None:
            self._stop(self.cfg.replica.server_shutdown_timeout_s + 10)
        log = getattr(self, "log", None)
        if log is not None:
            log.close()
            os.unlink(log.name)


def _gone_meta(replica_id: str) -> dict:
    return {"status": 400, "content_type": "application/json", "replica": replica_id}


def _gone(pin: str, public_id: object, param: str | None) -> bytes:
    """The answer for a stored response whose replica is no longer running (Serve replaced or
    removed it: its responses went with it)."""
    what = "previous_response_id: response" if param else "response"
    msg = f"{what} not found: replica {pin!r}, which stored it, is no longer running"
    code = "previous_response_not_found" if param else "not_found"
    err = {"message": msg, "type": "invalid_request_error", "param": param, "code": code}
    return json.dumps({"error": err}).encode()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (not expected): still a usable label
        return f"pid-{os.getpid()}"
