"""Prefill/decode disaggregation on one 2-core machine (issue 17): decoding streams while long
prompts arrive, colocated on both cores vs prefill on core 0 and decode on core 1.

`--streams` clients each loop streaming completions (short prompts, `--stream-tokens` tokens,
greedy, ignore_eos) while a `--long-len`-token prompt arrives every `--every` seconds
(`--long-count` of them, distinct). Configurations, each its own fresh server(s):
  colocated       one `kvserve serve` on cores 0-1 (2 threads)
  colocated-cap   the same with --long-prefill-token-threshold 64 (prefill chunks while decoding)
  disaggregated   a kv_producer on core 0 and a kv_consumer on core 1 (1 thread each, `taskset`),
                  `kvserve pd-proxy` in front; every request (streams too) goes prefill -> decode
Printed per configuration: the streams' inter-token latency p50 / p99 (gaps between content
chunks, during the long-prompt phase), their output tok/s, the long prompts' TTFT, and for the
disaggregated run the KV transfers (count, MB, MB/s, ms each) from the consumer's /metrics, over
the whole run and for three long prompts sent afterwards with nothing else running.

    python benchmarks/bench_disagg.py [--modes colocated,colocated-cap,disaggregated]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], cores: str, threads: int, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    full = [
        "taskset",
        "-c",
        cores,
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        *cmd,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(full, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def launch(mode: str, args) -> tuple[list[subprocess.Popen], str, str | None]:
    """The processes, the URL clients use, and the consumer's URL (for transfer metrics)."""
    serve = ["serve", MODEL, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "4096"]
    if mode.startswith("colocated"):
        extra = ["--long-prefill-token-threshold", "64"] if mode == "colocated-cap" else []
        p, url = start(serve + extra, "0,1", 2, f"/tmp/bench_disagg_{mode}.log")
        wait_healthy(url, p)
        return [p], url, None
    kv = lambda role: json.dumps({"kv_connector": args.connector, "kv_role": role})  # noqa: E731
    prod, purl = start(serve + ["--kv-transfer-config", kv("kv_producer")], "0", 1, "/tmp/bench_disagg_p.log")
    cons, curl = start(serve + ["--kv-transfer-config", kv("kv_consumer")], "1", 1, "/tmp/bench_disagg_d.log")
    wait_healthy(purl, prod)
    wait_healthy(curl, cons)
    proxy, url = start(["pd-proxy", "--prefill", purl, "--decode", curl], "0,1", 1, "/tmp/bench_disagg_x.log")
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=2)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "pd-proxy did not start"
            time.sleep(0.3)
    return [proxy, prod, cons], url, curl


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the content chunks (the first one marks the TTFT)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.monotonic())
    return times


async def run_load(url: str, args, short: list[list[int]], long: list[list[int]]) -> dict:
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        # Warm-up: one long and a batch of short ones (compiles the shape buckets both need).
        await stream_one(client, url, long[args.long_count], 4)
        await asyncio.gather(*(stream_one(client, url, p, 8) for p in short[: args.streams]))
        t0 = time.monotonic()
        end_long = t0 + args.every * args.long_count + 1
        gaps, tokens, phase = [], [0], [t0, None]

        async def streamer(i: int) -> None:
            k = 0
            while time.monotonic() < end_long or phase[1] is None:
                times = await stream_one(
                    client, url, short[(i + k * args.streams) % len(short)], args.stream_tokens
                )
                tokens[0] += len(times)
                gaps.extend(
                    b - a
                    for a, b in zip(times, times[1:])
                    if a >= t0 + 1 and (phase[1] is None or b <= phase[1])
                )
                k += 1

        async def arrivals() -> list[float]:
            ttfts = []
            for j in range(args.long_count):
                await asyncio.sleep(max(0.0, t0 + 1 + j * args.every - time.monotonic()))
                sent = time.monotonic()
                times = await stream_one(client, url, long[j], 8)
                ttfts.append(times[0] - sent)
            phase[1] = time.monotonic()
            return ttfts

        results = await asyncio.gather(arrivals(), *(streamer(i) for i in range(args.streams)))
        ttfts, span = results[0], phase[1] - t0
    g = np.array(gaps)
    return {
        "itl_p50_ms": round(float(np.percentile(g, 50)) * 1000, 1),
        "itl_p99_ms": round(float(np.percentile(g, 99)) * 1000, 1),
        "itl_max_ms": round(float(g.max()) * 1000, 1),
        "stream_tok_s": round(tokens[0] / span, 1),
        "long_ttft_mean_s": round(float(np.mean(ttfts)), 2),
        "long_ttft_max_s": round(float(np.max(ttfts)), 2),
        "phase_s": round(span, 1),
    }


def idle_transfer(url: str, consumer: str, long: list[list[int]]) -> dict:
    """Transfers of long prompts neither engine has seen, with nothing else running (after the
    load run)."""
    before = metrics(consumer)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for p in long:
                await stream_one(client, url, p, 2)

    asyncio.run(go())
    after = metrics(consumer)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("kvserve:kv_transfers_total",
         "kvserve:kv_transfer_bytes_total", "kvserve:kv_transfer_seconds_total")}  # fmt: skip
    n, mb, s = (
        d["kvserve:kv_transfers_total"],
        d["kvserve:kv_transfer_bytes_total"] / 1e6,
        d["kvserve:kv_transfer_seconds_total"],
    )
    return {"idle_long_transfer_mb": round(mb / n, 1), "idle_long_transfer_ms": round(1000 * s / n, 1),
            "idle_long_transfer_mb_s": round(mb / s, 1)} if n else {}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="colocated,colocated-cap,disaggregated")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-len", type=int, default=100)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-count", type=int, default=4)
    ap.add_argument("--every", type=float, default=8.0)
    ap.add_argument("--connector", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--kv-cache-memory", default="768MiB")
    args = ap.parse_args()
    from kvserve.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(MODEL))
    short = make_prompts(tok, args.streams * 8, args.stream_len, seed=1)
    long = make_prompts(tok, args.long_count + 4, args.long_len, seed=2, jitter=0)  # +1 warm-up, +3 idle
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.streams} streams x {args.stream_len}-token prompts x {args.stream_tokens} tokens; "
          f"{args.long_count} x {args.long_len}-token prompts every {args.every}s; {MODEL} fp32")  # fmt: skip
    for mode in args.modes.split(","):
        procs, url, consumer = launch(mode, args)
        try:
            row = asyncio.run(run_load(url, args, short, long))
            if consumer is not None:
                row.update(idle_transfer(url, consumer, long[args.long_count + 1 :]))
                m = metrics(consumer)
                n, mb = (
                    m.get("kvserve:kv_transfers_total", 0),
                    m.get("kvserve:kv_transfer_bytes_total", 0) / 1e6,
                )
                s = m.get("kvserve:kv_transfer_seconds_total", 0)
                failed = int(m.get("kvserve:kv_transfer_failures_total", 0))
                row.update(transfers=int(n), transfer_failures=failed, transfer_mb=round(mb, 1),
                           transfer_mb_s=round(mb / s, 1) if s else None,
                           transfer_ms_each=round(1000 * s / n, 1) if n else None)  # fmt: skip
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        print(json.dumps({"mode": mode, **row, "load_avg": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
