"""Data-parallel serve: routing policies on a multi-tenant chat workload, and the router's cost.

For each policy a fresh `kvserve serve --data-parallel-size 2 --routing-policy P` (one thread
per replica on 2 cores) gets the same Poisson stream: `--tenants` distinct system prompts of
~`--system-tokens` tokens, each request one of them + a ~`--question-tokens`-token question,
streamed, `--output-len` tokens out. Reported per policy: prefix-cache hit rate (server
counters), TTFT p50/p99 (client side, to the first streamed token), throughput, and tokens
computed per replica (`kvserve:iteration_tokens_sum{engine}`). `--skew 0.8` sends 80% of
requests to tenant 0. The KV pool per replica (`--kv-cache-memory`) is sized to hold about
half the tenants, so where a prefix lives matters. Then the router microbenchmark: decisions
for a prompt of system + question tokens against `--cached-prefixes` prefixes per replica.

    python benchmarks/bench_data_parallel.py                       # the issue's full workload
    python benchmarks/bench_data_parallel.py --requests 64 --skew 0.8 --policies cache-aware
    python benchmarks/bench_data_parallel.py --through-gateway --requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import yaml
from cpu_info import cpu_flags

from kvserve.core.block_pool import hash_prompt_blocks
from kvserve.routing import BlockHashIndex, CacheAware, RequestInfo, TextPrefixIndex

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(args) -> list[tuple[float, int, str]]:
    """(arrival offset s, tenant, prompt) for every request; each word is one smollm2 token
    (measured: the 8 system prompts are 1,010 tokens each, a whole prompt ~1,063)."""
    rng = random.Random(args.seed)
    systems = [
        f"System {t}: you are agent {t}. " + words(rng, args.system_tokens) for t in range(args.tenants)
    ]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        hot = args.skew is not None and rng.random() < args.skew
        tenant = 0 if hot else rng.randrange(args.tenants)
        out.append((t, tenant, systems[tenant] + "\n\nQuestion: " + words(rng, args.question_tokens)))
    return out


def metric_by_engine(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        e = re.search(r'engine="([^"]+)"', m.group(1))
        key = e.group(1) if e else "total"
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


async def one(http: httpx.AsyncClient, url: str, body: dict, delay: float, slot: list) -> None:
    """One streamed request; slot = [ttft or None, "ok" | "failed" | "unfinished"], filled as it
    goes, so a request cancelled at the deadline keeps the TTFT it had reached."""
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                slot[1] = "failed"
                return
            async for line in r.aiter_lines():
                if (
                    slot[0] is None
                    and line.startswith("data: {")
                    and '"text":""' not in line.replace(" ", "")
                ):
                    slot[0] = time.perf_counter() - t0
    except httpx.HTTPError:
        slot[1] = "failed"
        return
    slot[1] = "ok"


def wait_ready(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.5)


def start_server(
    args, port: int, *extra: str, env: dict | None = None, wait: bool = True
) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "serve", args.model, "--port", str(port),
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048", "--max-num-seqs", "32",
        "--served-model-name", "m", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    if wait:
        wait_ready(f"http://127.0.0.1:{port}/health/ready", proc, "kvserve serve")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def drive(url: str, args, reqs, headers: dict | None = None) -> tuple[list, float]:
    """The Poisson stream against url; [ttft, state] per request and the wall time. Requests
    still running `--drain-timeout` s after the last arrival are cancelled (the client
    disconnects, the server aborts them) and count as unfinished: the run time is bounded
    even for a policy that cannot keep up."""

    async def go():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        slots = [[None, "unfinished"] for _ in reqs]
        async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as http:
            bodies = [
                {"model": "m", "prompt": p, "max_tokens": args.output_len, "ignore_eos": True,
                 "temperature": 0, "stream": True}
                for _, _, p in reqs
            ]  # fmt: skip
            tasks = [
                asyncio.create_task(one(http, url, b, t, slot))
                for b, (t, _, _), slot in zip(bodies, reqs, slots)
            ]
            _, pending = await asyncio.wait(tasks, timeout=reqs[-1][0] + args.drain_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return slots

    t0 = time.perf_counter()
    results = asyncio.run(go())
    return results, time.perf_counter() - t0


def _round(x: float) -> float | str:
    return round(x, 3) if math.isfinite(x) else "inf"


def summary(policy: str, args, results, wall: float, before: list[str], after: list[str], per_engine: bool):
    """Hit rate and tokens computed from the servers' /metrics (several servers: summed, one
    entry per server; one data-parallel server: one entry per replica)."""

    def delta(name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, (b_text, a_text) in enumerate(zip(before, after)):
            a, b = metric_by_engine(a_text, name), metric_by_engine(b_text, name)
            for k, v in a.items():
                key = k if per_engine else (f"server{i}" if k == "total" else None)
                if key is not None:
                    out[key] = out.get(key, 0.0) + v - b.get(k, 0.0)
        return out

    hits, queries = delta("kvserve:prefix_cache_hits_total"), delta("kvserve:prefix_cache_queries_total")
    computed = delta("kvserve:iteration_tokens_sum")
    per = {k: v for k, v in computed.items() if k != "total"}
    # TTFT over every request that did not fail: one still waiting for its first token at the
    # deadline counts as infinite (censored), so an overloaded policy's percentiles are not
    # flattered by leaving its slowest requests out.
    ttfts = sorted(t if t is not None else math.inf for t, state in results if state != "failed")
    ok = sum(1 for _, state in results if state == "ok")
    hit_total = sum(v for k, v in hits.items() if k != "total")
    query_total = sum(v for k, v in queries.items() if k != "total")
    return {
        "policy": policy,
        "ok": ok,
        "hit_rate": round(hit_total / max(query_total, 1), 4),
        "failed": sum(1 for _, state in results if state == "failed"),
        "unfinished": sum(1 for _, state in results if state == "unfinished"),
        "ttft_p50_s": _round(statistics.median(ttfts)) if ttfts else None,
        "ttft_p99_s": _round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]) if ttfts else None,
        "req_per_s": round(ok / wall, 4),
        "out_tok_per_s": round(ok * args.output_len / wall, 2),
        "tokens_computed_per_replica": per,
        "replica_imbalance": round(max(per.values()) / max(min(per.values()), 1), 3) if per else None,
    }


def run_policy(policy: str, args, reqs) -> dict:
    """One `kvserve serve --data-parallel-size 2` with this routing policy."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, "--data-parallel-size", "2", "--routing-policy", policy)
    try:
        before = [httpx.get(f"{base}/metrics").text]
        results, wall = drive(f"{base}/v1/completions", args, reqs)
        after = [httpx.get(f"{base}/metrics").text]
    finally:
        stop(proc)
    return summary(policy, args, results, wall, before, after, per_engine=True)


def serve_runs(policies: list[str], args, reqs):
    for policy in policies:
        t0 = time.strftime("%H:%M:%S", time.gmtime())
        out = run_policy(policy, args, reqs)
        out["utc"] = f"{t0}-{time.strftime('%H:%M:%S', time.gmtime())}"
        yield out


def idle_and_reset(port: int) -> None:
    """Wait for the server to finish (or abort) what the last policy left, then empty its prefix
    cache, so the next policy starts cold as with a fresh server."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        busy = [metric_by_engine(text, f"kvserve:num_requests_{k}") for k in ("running", "waiting")]
        if sum(sum(b.values()) for b in busy) == 0:
            break
        time.sleep(1)
    httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", timeout=60).raise_for_status()


def run_gateway(policies: list[str], args, reqs, workdir: str):
    """`kvserve gateway` with each routing strategy in turn over the same two single-replica
    `kvserve serve`s (one thread each; prefix caches emptied between strategies, which saves
    two server starts per strategy): the gateway's approximate (text) cache-aware index."""
    ports = [free_port(), free_port()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    servers = [start_server(args, p, env=env, wait=False) for p in ports]
    try:
        for proc, p in zip(servers, ports):
            wait_ready(f"http://127.0.0.1:{p}/health/ready", proc, "kvserve serve")
        for policy in policies:
            t0 = time.strftime("%H:%M:%S", time.gmtime())
            for p in ports:
                idle_and_reset(p)
            gw_port = free_port()
            cfg = {
                "model_list": [
                    {"model_name": "m", "backend": {"base_url": f"http://127.0.0.1:{p}/v1", "model": "m",
                                                    "first_byte_timeout": 600, "idle_timeout": 600}}
                    for p in ports
                ],
                "router_settings": {"routing_strategy": policy, "num_retries": 0},
                "keys": [{"key": "sk-bench"}],
                "general_settings": {"database": os.path.join(workdir, f"gw-{policy}.db")},
            }  # fmt: skip
            path = os.path.join(workdir, f"gw-{policy}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(cfg, f)
            gw = subprocess.Popen(
                [sys.executable, "-m", "kvserve.entrypoints.cli", "gateway", "--config", path,
                 "--port", str(gw_port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                wait_ready(f"http://127.0.0.1:{gw_port}/health", gw, "gateway")
                before = [httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in ports]
                auth = {"Authorization": "Bearer sk-bench"}
                results, wall = drive(f"http://127.0.0.1:{gw_port}/v1/completions", args, reqs, auth)
                after = [httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in ports]
            finally:
                stop(gw)
            out = summary(f"gateway/{policy}", args, results, wall, before, after, per_engine=False)
            out["utc"] = f"{t0}-{time.strftime('%H:%M:%S', time.gmtime())}"
            yield out
    finally:
        for proc in servers:
            stop(proc)


def microbench(args) -> dict:
    """Decision cost (wall, and this thread's CPU time, which a shared machine's preemption
    does not inflate) with `cached_prefixes` 256-token prefixes per replica plus the tenants', for
    the exact index (token ids) and the text index (the same ids written out as text, ~6
    characters a token, stored through `routed` as the gateway does)."""
    rng = random.Random(1)
    exact = BlockHashIndex(16)
    text = TextPrefixIndex(max_chunks_per_target=args.cached_prefixes * 32)  # keeps them all
    for r in ("0", "1"):
        hashes: list[bytes] = []
        for _ in range(args.cached_prefixes):
            prefix = [rng.randrange(49152) for _ in range(256)]
            hashes += hash_prompt_blocks(prefix, 16)
            text.routed(r, RequestInfo(text=" ".join(map(str, prefix))))
        exact.apply(r, hashes, [], False)
    systems = [[rng.randrange(49152) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    for t, s in enumerate(systems):
        exact.apply(str(t % 2), hash_prompt_blocks(s, 16), [], False)
        text.routed(str(t % 2), RequestInfo(text=" ".join(map(str, s))))

    class Target:
        def __init__(self, i: str) -> None:
            self.id, self.weight, self.load = i, 1.0, 0

    targets = [Target("0"), Target("1")]
    out = {}
    for name, ca, make in (
        ("exact", CacheAware(exact), lambda s, q: RequestInfo(token_ids=s + q)),
        ("text", CacheAware(text), lambda s, q: RequestInfo(text=" ".join(map(str, s + q)))),
    ):
        times, cpu, wrong = [], [], 0
        for i in range(args.decisions):
            t = i % len(systems)
            info = make(systems[t], [rng.randrange(49152) for _ in range(args.question_tokens)])
            t0, c0 = time.perf_counter(), time.thread_time()
            choice = ca.choose(targets, info)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            wrong += choice.id != str(t % 2)
        times.sort()
        cpu.sort()
        out[name] = {
            "p50_ms": round(1e3 * times[len(times) // 2], 4),
            "p99_ms": round(1e3 * times[int(0.99 * len(times))], 4),
            "cpu_p50_ms": round(1e3 * cpu[len(cpu) // 2], 4),
            "cpu_p99_ms": round(1e3 * cpu[int(0.99 * len(cpu))], 4),
            "cached_keys_per_replica": (exact if name == "exact" else text).size("0"),
            "not_the_holder": wrong,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", default="cache-aware,round-robin,least-loaded")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--skew", type=float, default=None, help="fraction of requests on tenant 0")
    p.add_argument(
        "--kv-cache-memory",
        default="203MiB",
        help="per replica: 288 blocks of 16 smollm2 tokens (720 KiB each), i.e. 4 of the 8 tenants' "
        "63-block prefixes + 36 blocks for the running batch",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cached-prefixes", type=int, default=10_000)
    p.add_argument("--decisions", type=int, default=10_000)
    p.add_argument("--skip-serve", action="store_true", help="only the router microbenchmark")
    p.add_argument(
        "--through-gateway",
        action="store_true",
        help="instead of one `serve --data-parallel-size 2`: `kvserve gateway --routing-strategy P` "
        "over two one-thread `kvserve serve`s (the gateway's text index)",
    )
    p.add_argument("--drain-timeout", type=float, default=90, help="s after the last arrival")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally`: stop the servers
    print(f"# cpu flags: {cpu_flags()}", flush=True)
    print(f"# args: {vars(args)}", flush=True)
    if not args.skip_serve:
        reqs = workload(args)
        policies = args.policies.split(",")
        with tempfile.TemporaryDirectory() as workdir:
            runs = (
                run_gateway(policies, args, reqs, workdir)
                if args.through_gateway
                else serve_runs(policies, args, reqs)
            )
            for result in runs:
                result["load_avg_5min_at_end"] = round(os.getloadavg()[1], 2)  # the machine is shared
                print(json.dumps(result), flush=True)
    if args.decisions:
        print(json.dumps({"router_microbench": microbench(args)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
