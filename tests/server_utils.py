"""Start a real `kvserve serve` process on 127.0.0.1 for tests, and read its /metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        model: str,
        *args: str,
        api_key: str | None = "test-key",
        timeout: float = 180,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        new_session: bool = False,
    ) -> None:
        """`cwd` also picks the kvserve tree that runs (`python -m` imports from there first);
        `new_session`: the server and its children in a process group of their own (its id the
        server's pid), as a service manager or `setsid` starts them."""
        self.port = free_port()
        tls = "--ssl-certfile" in args  # the probe below trusts any certificate; tests pin theirs
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [
            sys.executable,
            "-m",
            "kvserve.entrypoints.cli",
            "serve",
            model,
            "--port",
            str(self.port),
            *args,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd,
            start_new_session=new_session,
        )  # fmt: skip
        up = lambda: httpx.get(f"{self.url}/health", timeout=1, verify=not tls).status_code == 200  # noqa: E731
        wait_up(self.proc, up, timeout, "server", self.stop, poll=0.3)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (summed over labels)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
        return values

    def engine_core_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = " ".join(child.cmdline())
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                return child.pid
        raise RuntimeError("engine core process not found")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def wait_up(
    proc: subprocess.Popen, up: Callable[[], bool], timeout: float, what: str, stop: Callable[[], None],
    poll: float = 0.1,
) -> None:  # fmt: skip
    """Until `up()` (an HTTP error counts as not yet). Whatever ends the wait otherwise (the
    process exiting, the timeout, Ctrl-C, an error) calls `stop()` first: a helper whose start
    failed raised with its process still running, which outlived the test run."""
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            try:
                if up():
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not come up within {timeout:g} s")
            time.sleep(poll)
    except BaseException:
        stop()
        raise


def stop_process(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds (and reaped)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
