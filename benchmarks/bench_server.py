"""Server throughput against the offline engine on the same workload, same run.

64 concurrent streaming completions (token-id prompts of ~128 tokens, 128 output tokens,
greedy, ignore_eos) against `kvserve serve` on the default model, then the same requests
through the offline `LLM` in this process. The server should keep at least 85% of the
offline engine's output throughput: HTTP, SSE and the process hop must not cost much.

    python benchmarks/bench_server.py [--num-requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import httpx  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

from benchmarks.common import machine, make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.loader import load_tokenizer, resolve_model  # noqa: E402


async def stream_all(
    url: str, headers: dict, prompts: list[list[int]], output_len: int
) -> tuple[int, float, int]:
    body = {
        "model": "smollm2-135m", "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    errors = 0

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> int:
        nonlocal errors
        n = 0
        async with http.stream(
            "POST", f"{url}/v1/completions", json={**body, "prompt": prompt}, headers=headers
        ) as r:
            if r.status_code != 200:
                errors += 1
                return 0
            async for line in r.aiter_lines():
                if '"usage":{' in line:  # only the final chunk is parsed: keep the client cheap
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
        return n

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(http, p) for p in prompts))
        return sum(counts), time.perf_counter() - t0, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()

    server = ServerProcess("smollm2-135m", "--kv-cache-memory", "2GiB", api_key=None)
    try:
        tok = load_tokenizer(resolve_model("smollm2-135m"))
        prompts = make_prompts(tok, args.num_requests, args.prompt_len)
        asyncio.run(stream_all(server.url, server.headers, prompts[:4], 8))  # warm-up
        tokens, secs, errors = asyncio.run(stream_all(server.url, server.headers, prompts, args.output_len))
    finally:
        server.stop()
    server_tps = tokens / secs

    llm = LLM("smollm2-135m", kv_cache_memory="2GiB")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    offline_secs = time.perf_counter() - t0
    offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / offline_secs

    res = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "workload": vars(args),
        "server": {"output_tokens": tokens, "seconds": secs, "tok_per_s": server_tps, "errors": errors},
        "offline": {"seconds": offline_secs, "tok_per_s": offline_tps},
        "ratio_server_vs_offline": server_tps / offline_tps,
    }  # fmt: skip
    print(json.dumps(res, indent=1))
    ratio = server_tps / offline_tps
    print(f"\nserver {server_tps:.1f} tok/s, offline {offline_tps:.1f} tok/s, ratio {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
