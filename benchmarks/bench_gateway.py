"""Gateway benchmarks, each against a baseline measured in the same run:

overhead  added latency (p50/p99) and max req/s of one gateway process in front of a stub
          backend that answers at once (tests/bench_stub.py), vs calling the stub directly;
          once with state: memory and a key without limits, once with state: redis and a
          key with rpm + tpm + parallel + budget limits (every request does admission and
          settlement through the Lua scripts)
stream    32 concurrent streams straight to `kvserve serve` (default model) vs through the
          gateway: output tokens per second, ratio
memory    gateway RSS after 1,000 and after 20,000 stub requests

python benchmarks/bench_gateway.py overhead|stream|memory|all
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from gateway_utils import GatewayProcess, RedisServer  # noqa: E402
from server_utils import ServerProcess, free_port  # noqa: E402

KEY = "sk-bench"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


def machine() -> str:
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0]
    simd = [f for f in ("avx2", "avx512f") if f" {f} " in flags + " "]
    model = [ln for ln in open("/proc/cpuinfo") if ln.startswith("model name")][0].split(":")[1].strip()
    return f"{model}, {os.cpu_count()} cores, flags include {'/'.join(simd) or 'no avx2'}"


class Stub:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        stub = os.path.join(HERE, "..", "tests", "bench_stub.py")
        self.proc = subprocess.Popen([sys.executable, stub, "--port", str(self.port)])
        for _ in range(100):
            try:
                httpx.post(self.url + "/v1/chat/completions", json={}, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("stub did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def gateway(
    backend_url: str,
    tmp: str,
    state: str = "memory",
    limited: bool = False,
    name: str = "gw",
    model: str = "stub",
):
    key = {"key": KEY}
    if limited:  # limits high enough never to refuse, so every request pays for the checks
        key.update(rpm=10**9, tpm=10**12, max_parallel_requests=10**6, max_budget=10.0**9)
    cfg = {
        "model_list": [
            {
                "model_name": "m",
                "backend": {"base_url": backend_url + "/v1", "model": model, "input_cost_per_token": 1e-6},
            }
        ],
        "keys": [key],
        "general_settings": {"state": state, "database": os.path.join(tmp, name + ".db")},
    }
    return GatewayProcess(cfg, tmp, name)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def latencies(direct: str, via: str, n: int, path: str = "/v1/chat/completions") -> dict:
    """One request at a time, alternating blocks of 50 so drift hits both paths alike."""
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as c:
        for url in (direct, via):  # warm-up
            for _ in range(50):
                c.post(url + path, json=BODY, headers=h)
        for _ in range(n // 100):
            for name, url in (("direct", direct), ("gateway", via)):
                for _ in range(50):
                    t0 = time.perf_counter()
                    r = c.post(url + path, json=BODY, headers=h)
                    out[name].append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
    return out


def throughput(url: str, seconds: float, concurrency: int = 64) -> float:
    """Closed loop, `concurrency` workers, each with its own one-connection client (one httpx
    client with many connections would be the bottleneck, not what is measured)."""

    async def go():
        clients = [
            httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)
        ]
        h = {"Authorization": f"Bearer {KEY}"}
        end = time.perf_counter() + seconds
        done = 0

        async def worker(c: httpx.AsyncClient):
            nonlocal done
            while time.perf_counter() < end:
                r = await c.post(url + "/v1/chat/completions", json=BODY, headers=h)
                assert r.status_code == 200, r.text
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        rate = done / (time.perf_counter() - t0)
        for c in clients:
            await c.aclose()
        return rate

    return asyncio.run(go())


def bench_overhead(args) -> None:
    stub = Stub()
    redis = RedisServer()
    tmp = tempfile.mkdtemp()
    try:
        for label, state, limited in (
            ("memory, no limits", "memory", False),
            ("redis, rpm+tpm+parallel+budget", redis.url, True),
        ):
            gw = gateway(stub.url, tmp, state, limited, name=f"gw-{int(limited)}")
            try:
                lat = latencies(stub.url, gw.url, args.requests)
                d50, d99 = _pct(lat["direct"], 0.5), _pct(lat["direct"], 0.99)
                g50, g99 = _pct(lat["gateway"], 0.5), _pct(lat["gateway"], 0.99)
                rps_direct = throughput(stub.url, args.seconds)
                rps_gw = throughput(gw.url, args.seconds)
                print(
                    f"[{label}] latency over {len(lat['gateway'])} sequential requests: direct p50 "
                    f"{d50 * 1e3:.2f} ms p99 {d99 * 1e3:.2f} ms; gateway p50 {g50 * 1e3:.2f} ms p99 "
                    f"{g99 * 1e3:.2f} ms; added p50 {(g50 - d50) * 1e3:.2f} ms, "
                    f"p99 {(g99 - d99) * 1e3:.2f} ms"
                )
                print(
                    f"[{label}] max req/s at 64 concurrent ({args.seconds:g} s each): direct "
                    f"{rps_direct:.0f}, gateway {rps_gw:.0f} (ratio {rps_gw / rps_direct:.2f})"
                )
            finally:
                gw.stop()
    finally:
        stub.stop()
        redis.stop()


def _streams(url: str, headers: dict, n: int, max_tokens: int) -> float:
    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": "m",
            "prompt": f"Story number {i}: once upon a time",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        tokens = 0
        async with c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, (await r.aread()).decode()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":""' not in line:
                    tokens += 1
        return tokens

    async def go():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(c, i) for i in range(n)))
            return sum(counts) / (time.perf_counter() - t0)

    return asyncio.run(go())


def bench_stream(args) -> None:
    srv = ServerProcess(
        "smollm2-135m", "--kv-cache-memory", "512MiB", "--served-model-name", "m", api_key=None, timeout=600,
        log_path=os.path.join(tempfile.gettempdir(), "bench_gateway_serve.log"),
    )  # fmt: skip
    tmp = tempfile.mkdtemp()
    gw = gateway(srv.url, tmp, model="m")
    try:
        _streams(srv.url, {}, 4, 8)  # warm-up
        direct, via = [], []
        import psutil

        gproc = psutil.Process(gw.proc.pid)
        for _ in range(args.rounds):
            direct.append(_streams(srv.url, {}, 32, args.max_tokens))
            cpu0 = sum(gproc.cpu_times()[:2])
            via.append(_streams(gw.url, {"Authorization": f"Bearer {KEY}"}, 32, args.max_tokens))
            cpu = sum(gproc.cpu_times()[:2]) - cpu0
            print(f"round: direct {direct[-1]:.1f} tok/s, gateway {via[-1]:.1f} tok/s "
                  f"(gateway process CPU {cpu:.2f} s for {32 * args.max_tokens} tokens)")  # fmt: skip
        d, g = statistics.mean(direct), statistics.mean(via)
        print(
            f"32 streams x {args.max_tokens} tokens, {args.rounds} interleaved rounds: direct {d:.1f} tok/s, "
            f"gateway {g:.1f} tok/s, ratio {g / d:.3f}"
        )
    finally:
        gw.stop()
        srv.stop()


def bench_memory(args) -> None:
    import psutil

    stub = Stub()
    tmp = tempfile.mkdtemp()
    gw = gateway(stub.url, tmp, limited=True)
    proc = psutil.Process(gw.proc.pid)

    errors = 0

    async def send(n: int, concurrency: int = 32):
        nonlocal errors
        clients = [
            httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)
        ]
        h = {"Authorization": f"Bearer {KEY}"}
        left = n

        async def worker(c: httpx.AsyncClient):
            nonlocal left, errors
            while left > 0:
                left -= 1
                try:
                    r = await c.post(gw.url + "/v1/chat/completions", json=BODY, headers=h)
                    assert r.status_code == 200, r.text
                except httpx.TransportError:  # a keep-alive connection closed as it was reused
                    errors += 1

        await asyncio.gather(*(worker(c) for c in clients))
        for c in clients:
            await c.aclose()

    try:
        asyncio.run(send(1000))
        time.sleep(1)
        rss_1k = proc.memory_info().rss
        asyncio.run(send(19000))
        time.sleep(1)
        rss_20k = proc.memory_info().rss
        print(
            f"gateway RSS after 1,000 requests {rss_1k / 2**20:.1f} MiB, "
            f"after 20,000 {rss_20k / 2**20:.1f} MiB "
            f"(growth {(rss_20k - rss_1k) / 2**20:+.1f} MiB); client transport errors: {errors}"
        )
    finally:
        gw.stop()
        stub.stop()


def bench_pools(args) -> None:
    stub = Stub()

    async def go(n_clients: int, per_client: int, seconds: float = 3.0) -> float:
        limits = httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client)
        clients = [httpx.AsyncClient(timeout=30, limits=limits) for _ in range(n_clients)]
        done, end = 0, time.perf_counter() + seconds

        async def worker(c: httpx.AsyncClient):
            nonlocal done
            while time.perf_counter() < end:
                await c.post(stub.url + "/v1/chat/completions", json=BODY)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(clients[i % n_clients]) for i in range(64)))
        for c in clients:
            await c.aclose()
        return done / (time.perf_counter() - t0)

    try:
        for n, per in ((1, 64), (16, 4), (64, 1)):
            rate = asyncio.run(go(n, per))
            print(f"64 concurrent requests, {n} httpx client(s) x {per} connections: {rate:.0f} req/s")
    finally:
        stub.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=("overhead", "stream", "memory", "pools", "all"))
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests per path (overhead)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput run (overhead)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (stream)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (stream)")
    args = ap.parse_args()
    print(machine(), "|", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    benches = {
        "overhead": bench_overhead,
        "stream": bench_stream,
        "memory": bench_memory,
        "pools": bench_pools,
    }
    for name in benches if args.which == "all" else (args.which,):
        benches[name](args)


if __name__ == "__main__":
    main()
