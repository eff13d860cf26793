"""Soak test of `kvserve serve`: many mixed requests at a fixed concurrency, then the books.

Mix: plain and streamed completions and chats, n > 1, structured outputs, stop strings,
streams the client abandons after the first chunk, and bad requests. Pass criteria (issue
"hardening"): zero 5xx, zero leaked KV blocks (usage 0 once idle), and RSS growth of each
process after warm-up (the first 1,000 requests) <= 20 MB.

    python benchmarks/soak_server.py --requests 10000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import socket
import subprocess
import sys
import time

import httpx
import psutil
from cpu_info import cpu_flags

BAD = [
    {"top_k": 2**63}, {"seed": 2**70}, {"priority": 2**70}, {"n": 1000}, {"temperature": "hot"},
    {"unknown_field": 1}, {"model": "no-such-model"}, {"max_tokens": 0}, {"logprobs": 99},
    {"stop": [""]}, {"logit_bias": {"x": 1}},
]  # fmt: skip
WORDS = "time year people way day man thing woman life child world school state family".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> dict[str, float]:
    """RSS of the API process and of each child (the engine core)."""
    p = psutil.Process(pid)
    out = {"api": p.memory_info().rss / 2**20}
    for c in p.children(recursive=True):
        if "resource_tracker" not in " ".join(c.cmdline()):
            out["core"] = c.memory_info().rss / 2**20
    return out


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            values[m.group(1)] += float(m.group(3))
    return values


def make_request(rng: random.Random, model: str) -> tuple[str, str, dict, bool]:
    """(kind, path, body, abandon after the first chunk)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    base = {"model": model, "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8])}
    chat = {**base, "messages": [{"role": "user", "content": prompt}]}
    comp = {**base, "prompt": prompt}
    kind = rng.choices(
        ["completion", "chat-stream", "n", "structured", "abandon", "stop", "bad"],
        weights=[30, 20, 10, 10, 10, 10, 10],
    )[0]
    if kind == "completion":
        return kind, "/v1/completions", comp, False
    if kind == "chat-stream":
        return (
            kind,
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            False,
        )
    if kind == "n":
        return kind, "/v1/completions", {**comp, "n": rng.randint(2, 3), "temperature": 0.8}, False
    if kind == "structured":
        so = rng.choice([{"choice": ["yes", "no", "maybe"]}, {"json_object": True}, {"regex": "[0-9]{1,4}"}])
        return kind, "/v1/chat/completions", {**chat, "structured_outputs": so}, False
    if kind == "abandon":
        return kind, "/v1/completions", {**comp, "stream": True, "max_tokens": 64, "ignore_eos": True}, True
    if kind == "stop":
        return kind, "/v1/completions", {**comp, "stop": [rng.choice(WORDS), "."], "max_tokens": 16}, False
    return (
        kind,
        rng.choice(["/v1/completions", "/v1/chat/completions"]),
        {**comp, **chat, **rng.choice(BAD)},
        False,
    )


async def one(http: httpx.AsyncClient, url: str, req, counts: collections.Counter) -> None:
    kind, path, body, abandon = req
    headers = {"Authorization": "Bearer soak"}
    if body.get("stream"):
        async with http.stream("POST", url + path, json=body, headers=headers) as r:
            async for _ in r.aiter_lines():
                if abandon:
                    break
            status = r.status_code
    else:
        status = (await http.post(url + path, json=body, headers=headers)).status_code
    counts[(kind, status // 100 * 100)] += 1


async def run(url: str, requests: list, concurrency: int, on_progress) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(requests):
        queue.put_nowait((i, r))

    async def worker(http):
        while not queue.empty():
            i, r = queue.get_nowait()
            try:
                await one(http, url, r, counts)
            except httpx.HTTPError as e:
                counts[(r[0], f"transport error {type(e).__name__}")] += 1
            on_progress(i)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"machine: {os.cpu_count()} cores, CPU flags: {cpu_flags()}, date {time.strftime('%Y-%m-%d %H:%M')}"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "serve", args.model, "--port", str(port),
        "--served-model-name", "m", "--api-key", "soak", "--max-num-seqs", "32",
        "--max-waiting-requests", "64", "--kv-cache-memory", "256MiB",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        rng = random.Random(args.seed)
        reqs = [make_request(rng, "m") for _ in range(args.requests)]
        warm = min(1000, args.requests // 2)  # by then the KV pool's pages are resident
        marks: dict[str, dict] = {}
        t0 = time.monotonic()

        def progress(i: int) -> None:
            if i == warm:
                marks["warm"] = rss_mb(server.pid)
            if i % 1000 == 0:
                print(f"  {i} requests, {time.monotonic() - t0:.0f}s", flush=True)

        counts = asyncio.run(run(url, reqs, args.concurrency, progress))
        elapsed = time.monotonic() - t0
        time.sleep(2)
        end = rss_mb(server.pid)
        m = metrics(url)
        by_status: collections.Counter = collections.Counter()
        for (_, status), n in counts.items():
            by_status[status] += n
        print(f"{args.requests} requests at concurrency {args.concurrency} in {elapsed:.0f}s "
              f"({args.requests / elapsed:.1f} req/s)")  # fmt: skip
        print("by status:", dict(by_status))
        print("by kind and status:", {f"{k}/{s}": n for (k, s), n in sorted(counts.items(), key=str)})
        running, waiting = m["kvserve:num_requests_running"], m["kvserve:num_requests_waiting"]
        print(f"idle: running={running:.0f} waiting={waiting:.0f} "
              f"kv_cache_usage={m['kvserve:kv_cache_usage_perc']:.4f}")  # fmt: skip
        growth = {k: end[k] - marks["warm"][k] for k in end}
        print("RSS MB after warm-up:", {k: round(v, 1) for k, v in marks["warm"].items()},
              "at end:", {k: round(v, 1) for k, v in end.items()},
              "growth:", {k: round(v, 1) for k, v in growth.items()})  # fmt: skip
        five = sum(n for s, n in by_status.items() if s == 500)
        transport = sum(n for s, n in by_status.items() if isinstance(s, str))
        ok = (
            five == 0 and transport == 0 and m["kvserve:kv_cache_usage_perc"] == 0
            and m["kvserve:num_requests_running"] == 0 and all(g <= 20 for g in growth.values())
        )  # fmt: skip
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
