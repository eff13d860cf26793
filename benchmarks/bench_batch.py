"""Batch API: does a running batch leave interactive latency alone, and does memory stay flat?

1. TTFT: sequential streaming chat requests against `kvserve serve` while idle, then while a
   large batch runs (the same server), in alternating rounds (each batch is cancelled before
   the next idle round). Target: p50 while the batch runs <= 1.5x idle p50.
2. RSS: a fresh server, idle RSS (API process + engine core) after interactive traffic
   (cold: after 3 sequential requests; idle: after a burst at concurrency 128 as well), then
   the peak while a --rss-lines input (max_tokens 1) is uploaded, validated and run. Target:
   within 100 MB of idle.

    python benchmarks/bench_batch.py [--ttft-model smollm2-135m] [--rss-model tiny]
        [--rss-lines 100000] [--json out.json]

"tiny" is the tests' random 2-layer Llama, saved to a temporary directory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

from benchmarks.cpu_info import cpu_flags  # noqa: E402

CHAT = "/v1/chat/completions"
# recorded with the result: settings that change the server's memory (the oneDNN cache caps
# are set by the engine unless given here; platform/onednn_cache.py)
SERVER_ENV = ("MALLOC_", "KVSERVE_", "ONEDNN_", "LRU_CACHE_CAPACITY")


def model_path(name: str, tmp: str) -> str:
    if name != "tiny":
        return name
    from conftest import _save_tiny

    return _save_tiny(os.path.join(tmp, "tiny"), "llama")


def batch_lines(n: int, max_tokens: int, model: str):
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"Write a line about item {i}."}],
                "max_tokens": max_tokens}  # fmt: skip
        yield json.dumps({"custom_id": f"b-{i}", "method": "POST", "url": CHAT, "body": body}) + "\n"


def write_input(path: str, n: int, max_tokens: int, model: str) -> int:
    with open(path, "w") as f:
        for ln in batch_lines(n, max_tokens, model):
            f.write(ln)
    return os.path.getsize(path)


def ttft(s: ServerProcess, model: str, i: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": f"Say hello to person {i}."}],
            "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, headers=s.headers, timeout=120) as r:
        for raw in r.iter_lines():
            if raw.startswith("data: ") and raw != "data: [DONE]":
                chunk = json.loads(raw[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


def tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def rss_of(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def bench_ttft(args, tmp: str) -> dict:
    model = model_path(args.ttft_model, tmp)
    store = os.path.join(tmp, "ttft-store")
    window = ("--batch-window", str(args.batch_window)) if args.batch_window else ()
    s = ServerProcess(model, "--served-model-name", "m", "--kv-cache-memory", "256MiB",
                      "--max-model-len", "1024", "--batch-storage-dir", store, *window)  # fmt: skip
    try:
        for i in range(3):
            ttft(s, "m", -i)  # warm
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key)
        path = os.path.join(tmp, "ttft-batch.jsonl")
        write_input(path, args.ttft_batch_lines, 16, "m")
        with open(path, "rb") as f:
            fid = c.files.create(file=("b.jsonl", f), purpose="batch").id
        idle, busy, done = [], [], 0
        n = args.ttft_requests // args.ttft_rounds
        for r in range(args.ttft_rounds):  # alternate, so a noisy neighbour hits both sides alike
            idle += [ttft(s, "m", 100 * r + i) for i in range(n)]
            b = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
            while c.batches.retrieve(b.id).request_counts.completed < 10:
                time.sleep(0.2)
            busy += [ttft(s, "m", 10000 + 100 * r + i) for i in range(n)]
            running = c.batches.retrieve(b.id)
            assert running.status == "in_progress", running.status
            done += running.request_counts.completed
            c.batches.cancel(b.id)
            while c.batches.retrieve(b.id).status != "cancelled":
                time.sleep(0.2)
        return {
            "model": args.ttft_model, "requests": len(idle), "rounds": args.ttft_rounds,
            "window": args.batch_window or "max_num_seqs",
            "idle_p50_s": statistics.median(idle), "busy_p50_s": statistics.median(busy),
            "ratio": statistics.median(busy) / statistics.median(idle), "batch_lines_done": done,
        }  # fmt: skip
    finally:
        s.stop()


def warm_burst(s: ServerProcess, n: int = 256) -> None:
    """Interactive traffic at concurrency 128, prompts of varied length: what a server that has
    been in use holds anyway (one oneDNN kernel per projection and batch-shape bucket)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        words = " ".join(["word"] * (i % 97))
        body = {"model": "m", "messages": [{"role": "user", "content": f"{words} {i}"}], "max_tokens": 4}
        httpx.post(
            f"{s.url}/v1/chat/completions", json=body, headers=s.headers, timeout=600
        ).raise_for_status()

    with ThreadPoolExecutor(128) as pool:
        list(pool.map(one, range(n)))


def bench_rss(args, tmp: str) -> dict:
    model = model_path(args.rss_model, tmp)
    path = os.path.join(tmp, "rss-batch.jsonl")
    size = write_input(path, args.rss_lines, 1, "m")
    s = ServerProcess(model, "--served-model-name", "m", "--kv-cache-memory", "64MiB",
                      "--max-model-len", "512", "--batch-storage-dir", os.path.join(tmp, "rss-store"),
                      "--max-upload-size", str(size + 1))  # fmt: skip
    try:
        for i in range(3):
            ttft(s, "m", i)
        time.sleep(1)
        api_pid, core_pid = s.proc.pid, s.engine_core_pid()
        cold, cold_api, cold_core = tree_rss(api_pid), rss_of(api_pid), rss_of(core_pid)
        if not args.no_burst:
            warm_burst(s)
            time.sleep(1)
        idle, idle_api, idle_core = tree_rss(api_pid), rss_of(api_pid), rss_of(core_pid)
        peak, stop = [idle, idle_api, idle_core], threading.Event()

        def sample() -> None:  # the tree, and each of the two processes on its own
            while not stop.is_set():
                now = (tree_rss(api_pid), rss_of(api_pid), rss_of(core_pid))
                peak[:] = [max(a, b) for a, b in zip(peak, now)]
                time.sleep(0.1)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key)
        t0 = time.monotonic()
        with open(path, "rb") as f:
            fid = c.files.create(file=("big.jsonl", f), purpose="batch").id
        b = c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
        deadline = t0 + args.rss_seconds if args.rss_seconds else None
        curve, step = [], max(1, args.rss_lines // 10)  # (lines done, API MB, core MB)
        while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
            if deadline is not None and time.monotonic() > deadline:
                break
            if b.request_counts.completed >= len(curve) * step:
                curve.append((b.request_counts.completed, rss_of(api_pid) / 1e6, rss_of(core_pid) / 1e6))
            time.sleep(1)
        curve.append((b.request_counts.completed, rss_of(api_pid) / 1e6, rss_of(core_pid) / 1e6))
        took = time.monotonic() - t0
        stop.set()
        t.join()
        return {
            "model": args.rss_model, "lines": args.rss_lines, "input_bytes": size, "status": b.status,
            "completed": b.request_counts.completed, "failed": b.request_counts.failed, "seconds": took,
            "cold_idle_rss_mb": cold / 1e6, "idle_rss_mb": idle / 1e6, "peak_rss_mb": peak[0] / 1e6,
            "delta_mb": (peak[0] - idle) / 1e6, "delta_vs_cold_mb": (peak[0] - cold) / 1e6,
            "api_mb": {"cold": cold_api / 1e6, "idle": idle_api / 1e6, "peak": peak[1] / 1e6},
            "core_mb": {"cold": cold_core / 1e6, "idle": idle_core / 1e6, "peak": peak[2] / 1e6},
            "curve_lines_api_core_mb": [(n, round(a, 1), round(k, 1)) for n, a, k in curve],
            "server_env": {k: v for k, v in os.environ.items() if k.startswith(SERVER_ENV)},
        }  # fmt: skip
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttft-model", default="smollm2-135m")
    ap.add_argument("--ttft-requests", type=int, default=40, help="on each side, idle and busy")
    ap.add_argument("--ttft-rounds", type=int, default=4)
    ap.add_argument("--ttft-batch-lines", type=int, default=5000)
    ap.add_argument("--batch-window", type=int, default=None, help="the server's --batch-window")
    ap.add_argument("--rss-model", default="tiny")
    ap.add_argument("--rss-lines", type=int, default=100_000)
    ap.add_argument(
        "--rss-seconds", type=float, default=0, help="stop sampling after this long (0: until done)"
    )
    ap.add_argument("--no-burst", action="store_true", help="idle = the cold server (no burst first)")
    ap.add_argument("--skip", choices=("ttft", "rss"), default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {"date": datetime.date.today().isoformat(), "cpu_flags": cpu_flags(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip != "ttft":
            result["ttft"] = bench_ttft(args, tmp)
            print(json.dumps(result["ttft"]), flush=True)
        if args.skip != "rss":
            result["rss"] = bench_rss(args, tmp)
            print(json.dumps(result["rss"]), flush=True)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
