"""The server's life: the engine core restarted when it dies, and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import time

import httpx
import psutil
import pytest
from server_utils import ServerProcess

MODEL_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "tiny")
LONG = {"model": "tiny", "prompt": "Go", "max_tokens": 240, "ignore_eos": True}


def ipc_files(tmpdir: str) -> set[str]:
    """The kvserve IPC files (sockets, shared-memory payloads) under `tmpdir`: the server runs
    with TMPDIR there, so another server on the host cannot add to them."""
    return set(glob.glob(os.path.join(tmpdir, "kvserve-*")))


async def read_stream(http: httpx.AsyncClient, s: ServerProcess, body: dict, started: list) -> list:
    """The SSE events of one streamed completion (parsed, with '[DONE]' kept as is)."""
    events = []
    async with http.stream(
        "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, headers=s.headers
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == 1:
                    started.append(time.monotonic())
    return events


def test_killed_core_is_restarted(tiny_llama_dir):
    t0 = time.monotonic()
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "1")
    startup = time.monotonic() - t0  # an upper bound on the model's load time
    try:

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [
                    asyncio.create_task(http.post(f"{s.url}/v1/completions", json=LONG, headers=s.headers))
                    for _ in range(6)
                ]
                await asyncio.sleep(0.5)
                old_pid = s.engine_core_pid()
                os.kill(old_pid, signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.gather(*tasks)
                failed_by = time.monotonic() - killed
                # While the core restarts every endpoint answers at once.
                t = time.monotonic()
                r = await http.post(f"{s.url}/reset_prefix_cache", headers=s.headers)
                dead_answer = (r, time.monotonic() - t)
                h = await http.get(f"{s.url}/health")
                return old_pid, killed, results, failed_by, dead_answer, h

        old_pid, killed, results, failed_by, (reset, reset_s), health = asyncio.run(scenario())
        codes = [r.status_code for r in results]
        assert 503 in codes and set(codes) <= {200, 503}, codes
        assert failed_by < 1.0  # in-flight requests fail at once
        # ... saying when to retry: the supervisor is starting a new core
        assert all(r.headers.get("retry-after") == "5" for r in results if r.status_code == 503)
        assert reset.status_code == 503 and reset_s < 1.0 and reset.headers.get("retry-after")
        assert health.status_code == 503
        deadline = killed + startup + 5 + 1  # load time + 5 s (+ the first back-off step)
        while True:
            r = httpx.post(f"{s.url}/v1/completions", json={**LONG, "max_tokens": 4}, headers=s.headers)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert s.engine_core_pid() != old_pid
        assert httpx.get(f"{s.url}/health").status_code == 200
        m = s.metrics()
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
    finally:
        s.stop()


def _post_many_then_kill(s: ServerProcess):
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{s.url}/v1/completions"
            tasks = [asyncio.create_task(http.post(url, json=LONG, headers=s.headers)) for _ in range(4)]
            while s.metrics().get("kvserve:num_requests_running", 0) == 0:
                await asyncio.sleep(0.05)
            os.kill(s.engine_core_pid(), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    return asyncio.run(scenario())


def test_restart_limit_zero_leaves_the_engine_down(tiny_llama_dir):
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--engine-restart-limit", "0")
    try:
        results = _post_many_then_kill(s)
        assert {r.status_code for r in results} <= {200, 503}
        time.sleep(0.5)
        r = httpx.post(f"{s.url}/v1/completions", json=LONG, headers=s.headers)
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead"
        assert "retry-after" not in r.headers
        assert httpx.get(f"{s.url}/health").status_code == 503
        assert httpx.get(f"{s.url}/health/ready").status_code == 503
        t = time.monotonic()
        assert httpx.post(f"{s.url}/reset_prefix_cache", headers=s.headers).status_code == 503
        assert time.monotonic() - t < 1.0  # it used to hang past 30 s
        m = s.metrics()  # no stale gauges from the dead core
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("to", ["server", "group"])
def test_sigterm_drains_in_flight_streams(tiny_llama_dir, to, tmp_path):
    """SIGTERM to the server alone, or to its whole process group as `timeout`, a terminal or a
    service manager sends it: the engine core (and any rank) ignores it, so the drain finishes
    the streams. Sent to the group, it once killed the core too: the server restarted it in the
    middle of the drain and the streams failed."""
    args = (*MODEL_ARGS, "--max-num-seqs", "8", "--shutdown-timeout", "20")
    s = ServerProcess(tiny_llama_dir, *args, new_session=to == "group", env={"TMPDIR": str(tmp_path)})
    try:
        assert ipc_files(str(tmp_path)), "the server's IPC files are not under its TMPDIR"
        children = psutil.Process(s.proc.pid).children(recursive=True)

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as http:
                started: list = []
                streams = [asyncio.create_task(read_stream(http, s, LONG, started)) for _ in range(8)]
                while len(started) < 8:
                    await asyncio.sleep(0.01)
                if to == "group":
                    os.killpg(s.proc.pid, signal.SIGTERM)
                else:
                    s.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.sleep(0.05)
                late = await http.post(f"{s.url}/v1/completions", json=LONG, headers=s.headers)
                ready = await http.get(f"{s.url}/health/ready")
                return await asyncio.gather(*streams), late, ready, sent

        events, late, ready, sent = asyncio.run(scenario())
        assert late.status_code == 503 and late.headers.get("retry-after")
        assert ready.status_code == 503
        for ev in events:
            assert ev[-1] == "[DONE]"
            assert ev[-2]["choices"][0]["finish_reason"] == "length"
        s.proc.wait(20)
        assert time.monotonic() - sent < 20
        assert s.proc.returncode == 0
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not ipc_files(str(tmp_path))
    finally:
        s.stop()


@pytest.mark.slow
def test_sigterm_deadline_ends_streams_with_an_error(tiny_llama_dir):
    """Streams still running at --shutdown-timeout get an error event and [DONE]."""
    s = ServerProcess(tiny_llama_dir, *MODEL_ARGS, "--max-num-seqs", "1", "--shutdown-timeout", "2")
    try:

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as http:
                started: list = []
                streams = [asyncio.create_task(read_stream(http, s, LONG, started)) for _ in range(12)]
                while not started:
                    await asyncio.sleep(0.01)
                s.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                return await asyncio.gather(*streams, return_exceptions=True), sent

        events, sent = asyncio.run(scenario())
        s.proc.wait(10)
        # the 2 s deadline plus a wide margin for a loaded machine (`cut` below checks the deadline acted)
        assert time.monotonic() - sent < 2 + 6
        cut = [ev for ev in events if isinstance(ev, list) and "error" in ev[-2]]
        assert cut, events  # twelve 240-token requests on one seat cannot all finish in 2 s
        for ev in cut:
            assert ev[-1] == "[DONE]" and ev[-2]["error"]["type"] == "server_shutting_down"
    finally:
        s.stop()
