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

import httpx

from kvserve.deploy.ray_config import RayDeployConfig

FORWARDED_HEADERS = ("authorization", "x-request-id", "x-session-id", "content-type")


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

    async def forward(self, path: str, body: dict, headers: dict[str, str]) -> AsyncIterator:
        """Stream one POST through: first {status, content_type, replica}, then the body's bytes
        as they arrive (SSE events for streams). Cancelled by Serve when the client leaves,
        which closes the connection, which aborts the request in the engine."""
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


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (not expected): still a usable label
        return f"pid-{os.getpid()}"
