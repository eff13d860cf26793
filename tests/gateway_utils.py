"""Real processes for gateway tests: a Redis server, the fault-injection backend and
`kvserve gateway` instances, each on a free 127.0.0.1 port and stopped afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import yaml
from server_utils import free_port, stop_process, wait_up

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _wait(url: str, proc: subprocess.Popen, timeout: float, what: str, stop) -> None:
    """Until `url` answers 200; a failed start is stopped (`stop`) before it raises."""
    wait_up(proc, lambda: httpx.get(url, timeout=1).status_code == 200, timeout, what, stop)


class RedisServer:
    """redis-server with persistence off (installed by `make test` when missing)."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: apt-get install -y redis-server (make test does)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.exe = exe
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        client = redis.Redis(port=self.port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_up(self.proc, up, 10, "redis-server", self.stop, poll=0.05)
        self.client = client

    def restart(self) -> None:
        """Stop and start again on the same port: without persistence it comes back empty."""
        self.stop()
        self.start()

    def stop(self) -> None:
        stop_process(self.proc, 10)


class FaultBackend:
    def __init__(self, timeout: float = 30) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fault_backend.py"), "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(self.url + "/health", self.proc, timeout, "fault backend", self.stop)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()

    def count(self, mode: str) -> int:
        return self.stats()["requests"].get(mode, 0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # it may hold deliberately hung requests; nothing to shut down cleanly
            self.proc.wait(10)


class GatewayProcess:
    """`kvserve gateway --config` in its own process (a real uvicorn server)."""

    def __init__(
        self, config: dict, workdir: str, name: str = "gw", wait: bool = True, timeout: float = 60
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = os.path.join(workdir, f"{name}.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "gateway", "--config", self.config_path,
             "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        self.timeout = timeout
        if wait:
            self.wait()

    def wait(self) -> None:
        _wait(self.url + "/health", self.proc, self.timeout, "gateway", self.stop)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def logs(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def deployment(alias: str, base_url: str, model: str, **backend) -> dict:
    return {"model_name": alias, "backend": {"base_url": base_url, "model": model, **backend}}


def leave_mid_body(url: str, path: str, headers: str = "") -> None:
    """Send a request's headers and half its declared body, then hang up."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\n"
                  "Content-Length: 1000\r\n\r\n{\"model\": ".encode())  # fmt: skip
        time.sleep(0.2)  # (lets the server start reading the body; not an assertion)


def wait_for_log(logs, text: str, timeout: float = 30) -> str:
    """The log (`logs()`) once `text` is in it, or as it is after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while text not in logs() and time.monotonic() < deadline:
        time.sleep(0.1)
    return logs()
