"""`kvserve deploy ray` on a real local Ray head (started here on free ports, stopped after):
under concurrent load through Serve's HTTP proxy the application scales from 1 to 2 kvserve
replicas, and back to 1 when the load drops, and no request fails in either transition: every
request answers 200 with a finish_reason, every stream ends with [DONE]. Light load (streams)
keeps running through the scale-down, so the replica being removed has streams in flight (it
drains them). Each replica is the tiny random Llama with one thread (two cores here)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import psutil
import pytest
import yaml
from server_utils import free_port

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "kvserve-test"
WORDS = "quick brown fox jumps over lazy dog paged cache blocks batching schedules step hello world".split()


@pytest.fixture(scope="module")
def ray_head():
    cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    subprocess.run(
        [cli, "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard=false",
         "--disable-usage-stats"],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        try:
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()  # graceful: each replica's destructor stops its server
        finally:
            ray.shutdown()
            subprocess.run([cli, "stop", "--force"], capture_output=True, timeout=120)


@dataclass
class Result:
    status: int = 0
    finish_reason: str | None = None
    done: bool = False
    replica: str | None = None
    t0: float = 0.0
    t1: float = 0.0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, max_tokens: int, stream: bool) -> Result:
    """One completion; `done`: a stream's [DONE], or a whole answer parsed."""
    r = Result(t0=time.monotonic())
    prompt = " ".join(random.choices(WORDS, k=12))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            r.status, r.replica = resp.status_code, resp.headers.get("x-kvserve-replica")
            if not stream:
                r.finish_reason = json.loads(await resp.aread())["choices"][0]["finish_reason"]
                r.done = True
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        r.done = True
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        r.finish_reason = choice.get("finish_reason") or r.finish_reason
    except Exception as e:  # a failed request is a result to report, not a crash of the load
        r.error = f"{type(e).__name__}: {e}"
    r.t1 = time.monotonic()
    return r


class Load:
    """Coroutines each sending one request after another until their `stop`."""

    def __init__(self, url: str) -> None:
        self.url, self.results = url, []

    async def worker(self, max_tokens: int, stop: asyncio.Event, stream: bool) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            while not stop.is_set():
                self.results.append(await one_request(client, max_tokens, stream))


async def same_prefix_replicas(url: str) -> list[str | None]:
    """Which replica served each of 6 requests sharing a 300-character prefix (one after
    another): cache-aware routing keeps them where the prefix is cached."""
    prefix = " ".join(WORDS * 3)[:300]
    served = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for i in range(6):
            body = {"model": "tiny", "prompt": f"{prefix} question {i}", "max_tokens": 4}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            served.append(resp.headers.get("x-kvserve-replica"))
    return served


DRAIN_LAG = 1.0  # s: Serve's drain-loop period (0.5 s) + two poller periods (0.25 s)


class StatusPoller(threading.Thread):
    """serve.status() every 0.25 s: (time, replica states) samples."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        from kvserve.deploy.ray_serve import replica_states

        while not self.halt.is_set():
            self.samples.append((time.monotonic(), replica_states(APP)))
            time.sleep(0.25)

    async def until(self, pred, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        seen = len(self.samples)
        while time.monotonic() < deadline:
            for t, states in self.samples[seen:]:
                if pred(states):
                    return t
            seen = len(self.samples)
            await asyncio.sleep(0.2)
        raise AssertionError(f"{what} within {timeout} s; last states {self.samples[-1:]}")


async def responses_stay_on_their_replica(url: str) -> None:
    """A stored Responses answer lives on its replica only: with two running, a follow-up
    (previous_response_id), a GET and a DELETE must reach that one (the front had no GET /
    DELETE, and a follow-up went wherever the router chose)."""
    from kvserve.routing.responses_ids import decode_id

    body = {"model": "tiny", "input": "a b", "max_output_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        first = await c.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        rid, home = first.json()["id"], first.headers["x-kvserve-replica"]
        assert decode_id(rid)[0] == home, rid
        for word in WORDS[:3]:
            nxt = await c.post("/v1/responses", json={**body, "input": word, "previous_response_id": rid})
            assert nxt.status_code == 200 and nxt.headers["x-kvserve-replica"] == home, nxt.text
            assert nxt.json()["previous_response_id"] == rid
            got = await c.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
        items = await c.get(f"/v1/responses/{rid}/input_items")  # (a 404 before: no such route)
        assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == "a b", items.text
        async with c.stream(
            "POST", "/v1/responses", json={**body, "previous_response_id": rid, "stream": True}
        ) as s:
            events = [json.loads(line[5:]) async for line in s.aiter_lines() if line.startswith("data: {")]
        assert s.headers["x-kvserve-replica"] == home and decode_id(events[-1]["response"]["id"])[0] == home
        assert (await c.delete(f"/v1/responses/{rid}")).status_code == 200
        gone = await c.get(f"/v1/responses/{rid}")
        assert gone.status_code == 404 and rid in gone.json()["error"]["message"], gone.text
        bad = await c.post("/v1/responses", json={**body, "previous_response_id": "resp_elsewhere"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "previous_response_not_found"


def _servers(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if tag in cmd and "serve" in cmd:
            found.append(p)
    return found


def test_scales_1_to_2_and_back_without_failing_a_request(ray_head, tiny_llama_dir, tmp_path):
    from ray import serve

    tag = f"tiny-{uuid.uuid4().hex[:8]}"  # served name: finds this test's server processes
    http_port = free_port()
    cfg = {
        "model": tiny_llama_dir, "app_name": APP, "served_model_name": [tag, "tiny"],
        "http": {"host": "127.0.0.1", "port": http_port},
        # 2 seats: of the 6 heavy streams 4 wait in the engine (counted by Serve, no CPU spent),
        # so the replica starting meanwhile gets a share of the 2 cores
        "engine": {"kv_cache_memory": "4MiB", "max_num_seqs": 2, "max_model_len": 512},
        "replica": {"num_cpus": 1, "threads": 1, "max_ongoing_requests": 8, "startup_timeout_s": 150,
                    "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 60},
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                        "upscale_delay_s": 0, "downscale_delay_s": 1, "metrics_interval_s": 0.5,
                        "look_back_period_s": 1},
        # recent work forgotten within seconds: new prefixes spread by what is in flight now
        "routing": {"policy": "cache-aware", "cache_aware": {"recent_work_tau": 1.0}},
    }  # fmt: skip
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t_start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "deploy", "ray", "--config", str(path),
         "--address", ray_head, "--detach"],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"http://127.0.0.1:{http_port}/v1" in out.stdout
    deploy_s = time.monotonic() - t_start

    ray.init(address=ray_head, logging_level="WARNING")
    poller = StatusPoller()
    poller.start()
    load = Load(f"http://127.0.0.1:{http_port}")

    async def scenario() -> dict:
        await poller.until(lambda s: s == {"RUNNING": 1}, 30, "one replica running after deploy")
        async with httpx.AsyncClient(
            base_url=load.url, timeout=30
        ) as c:  # monitors probe with HEAD (was 405)
            head = await c.head("/health")
            assert head.status_code == 200 and head.content == b"", head.status_code
            big = json.dumps({"model": "tiny", "prompt": "a" * (17 * 2**20)})  # read whole before (no limit)
            r = await c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
            card = await c.get("/v1/models/tiny")  # OpenAI's models.retrieve (was a 405)
            assert card.status_code == 200 and card.json()["id"] == "tiny", card.text
            for method, path in (("GET", "/v1/nope"), ("DELETE", "/v1/models")):  # was {"detail": ...}
                r = await c.request(method, path)
                assert r.status_code in (404, 405) and path in r.json()["error"]["message"], r.text
        heavy_stop, light_stop = asyncio.Event(), asyncio.Event()
        # Heavy: 6 requests at once, 3x the target per replica -> Serve wants 3, capped at 2. Not
        # streamed: each token of a stream crosses Serve's proxy, the front and the replica's
        # relay, and that CPU starved the starting replica (34-53 s to start under 6 streams).
        t_load = time.monotonic()
        tasks = [asyncio.create_task(load.worker(64, heavy_stop, stream=False)) for _ in range(6)]
        t_up = await poller.until(lambda s: s.get("RUNNING") == 2, 150, "scale-up to 2 replicas")
        shared = await same_prefix_replicas(load.url)  # both replicas serve the heavy load meanwhile
        await responses_stay_on_their_replica(load.url)
        # Light: 2 long streams (seconds each), 1 per replica, half the target -> Serve wants 1.
        tasks += [asyncio.create_task(load.worker(300, light_stop, stream=True)) for _ in range(2)]
        heavy_stop.set()
        t_light = time.monotonic()
        t_down = await poller.until(
            lambda s: s.get("RUNNING") == 1 and len(s) == 1, 120, "scale-down back to 1 replica"
        )
        deadline = time.monotonic() + 60  # one stream sent after it: which replica is left
        while not any(r.t0 > t_down for r in load.results) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        light_stop.set()
        await asyncio.gather(*tasks)
        return {"t_load": t_load, "t_up": t_up, "t_light": t_light, "t_down": t_down, "shared": shared}

    try:
        times = asyncio.run(scenario())
    finally:
        poller.halt.set()
        poller.join()
    res = load.results
    failed = [r for r in res if r.error or r.status != 200 or not r.done or r.finish_reason != "length"]
    assert not failed, f"{len(failed)} of {len(res)} requests failed: {failed[:5]}"
    replicas = {r.replica for r in res}
    assert len(replicas) == 2, f"expected requests on both replicas, saw {replicas}"
    assert len(set(times["shared"])) == 1 and None not in times["shared"], times["shared"]

    # The replica Serve removed: the one not serving after the scale-down completed.
    after = {r.replica for r in res if r.t0 > times["t_down"]}
    assert len(after) == 1, after
    (removed,) = replicas - after
    # When Serve first reported anything but two running replicas, it had begun to stop the
    # removed one. Serve may report that only once the replica's drain loop (every
    # graceful_shutdown_wait_loop_s = 0.5 s) saw its last request end, and the poller samples
    # every 0.25 s: a stream there that started before and was still running within
    # DRAIN_LAG of the report was in flight as the replica was drained (one run: a stream
    # ended 10 ms before the report, and the next went to the survivor).
    samples = poller.samples
    t_began = next(t for t, s in samples if t > times["t_light"] and s != {"RUNNING": 2})
    drained = [r for r in res if r.replica == removed and r.t0 < t_began and r.t1 > t_began - DRAIN_LAG]
    near = [(r.replica == removed, round(r.t0 - t_began, 2), round(r.t1 - t_began, 2)) for r in res
            if r.t1 > times["t_light"] - 2]  # fmt: skip
    assert drained, f"no stream in flight on the removed replica as it began to stop: {near}"
    starting = next(t for t, s in samples if "STARTING" in s)
    print(
        f"deploy {deploy_s:.1f} s; load at +{times['t_load'] - t_start:.1f} s, 2nd replica starting "
        f"+{starting - t_start:.1f} s, running +{times['t_up'] - t_start:.1f} s; light load "
        f"+{times['t_light'] - t_start:.1f} s, down +{times['t_down'] - t_start:.1f} s; {len(res)} "
        f"streams, {len(drained)} in flight on the removed replica as it stopped, 0 failed"
    )
    serve.delete(APP)
    deadline = time.monotonic() + 60
    while _servers(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servers(tag), "a replica's kvserve serve outlived the application"
