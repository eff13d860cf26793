"""What capping oneDNN's kernel caches costs and saves (kvserve/platform/onednn_cache.py).

Each (capacity, workload) runs in a fresh process (the caps are read once per process), the
capacities interleaved in every repeat so a noisy neighbour hits all of them alike:
  - batch: --batch-prompts short prompts (15-39 tokens), max_tokens 1, 1-20 arriving per step
    (at most 128 in flight), as the batch runner's lines reach the core: steps of every size,
    so many row-count buckets (the worst case for a capped cache);
  - decode: 64 requests x 128 prompt tokens x 64 output tokens submitted at once (as
    bench_engine.py): a few prefill buckets, then decode steps of one bucket;
  - steady (not by default): 8 requests x 300 output tokens, measured from their sixth step:
    a steady decode, which must compile nothing.
Reported per run: seconds, output tokens/s, oneDNN kernels compiled during the workload
(ONEDNN_VERBOSE=profile_create lines "create:cache_miss", after a warm-up) and the share of
the workload's time they took (oneDNN's own creation times: steadier than tokens/s on a
shared machine), and RSS growth over the workload (after malloc_trim on both sides). "1024"
is PyTorch's default capacity.

    python benchmarks/bench_onednn_cache.py [--model smollm2-135m|tiny] [--caps 1024 64 32]
        [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MARK = "--- measured workload ---"


def batch_like(llm, prompts: list[list[int]], window: int = 128, seed: int = 0) -> tuple[int, int]:
    """Max_tokens-1 prompts arriving 1-20 per step (at most `window` in flight): steps of
    ~30-512 tokens, as when the API process trickles a batch's lines in."""
    from kvserve import SamplingParams

    engine, rng = llm.llm_engine, random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    todo, inflight, tokens, steps = list(enumerate(prompts)), 0, 0, 0
    while todo or engine.has_unfinished_requests():
        add = min(rng.randint(1, 20), window - inflight) if todo else 0
        for _ in range(min(add, len(todo))):
            i, p = todo.pop()
            engine.add_request(f"b-{i}", p, params)
            inflight += 1
        for out in engine.step():
            if out.finished:
                inflight -= 1
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    return tokens, steps


def decode(llm, prompts: list[list[int]], output_len: int = 64) -> tuple[int, int]:
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d-{i}", p, params)
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        steps += 1
    return tokens, steps


def steady(llm, prompts: list[list[int]], output_len: int = 300) -> tuple[int, int]:
    """8 requests decoding together: after their first steps, every step is the same bucket.
    Only those later steps are counted (the mark is printed after 5 steps)."""
    from kvserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"s-{i}", p, params)
    for _ in range(5):
        engine.step()
    print(MARK, flush=True)
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        steps += 1
    return tokens, steps


def child(model: str, workload: str, batch_prompts: int) -> None:
    import psutil

    from benchmarks.common import make_prompts
    from kvserve import LLM, SamplingParams
    from kvserve.platform.memory import trim_heap

    llm = LLM(model, dtype="float32", kv_cache_memory="512MiB", max_model_len=512)
    if workload == "batch":
        prompts = make_prompts(llm.tokenizer, batch_prompts, 27, seed=1, jitter=12)
    else:
        prompts = make_prompts(llm.tokenizer, 64, 128, seed=2)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    proc = psutil.Process()
    trim_heap()
    rss0 = proc.memory_info().rss
    if workload != "steady":
        print(MARK, flush=True)
    t0 = time.perf_counter()
    tokens, steps = {"batch": batch_like, "decode": decode, "steady": steady}[workload](llm, prompts)
    seconds = time.perf_counter() - t0
    trim_heap()
    grow = (proc.memory_info().rss - rss0) / 1e6
    caps = {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    result = {"seconds": seconds, "tokens": tokens, "steps": steps, "rss_growth_mb": grow, "caps": caps}
    print("RESULT " + json.dumps(result), flush=True)


def run_one(model: str, workload: str, cap: int, batch_prompts: int) -> dict:
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = str(cap)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, workload, str(batch_prompts)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    after = out.split(MARK, 1)[1].splitlines()
    result = json.loads(next(ln for ln in after if ln.startswith("RESULT "))[7:])
    compiles = [float(ln.rsplit(",", 1)[1]) for ln in after if "create:cache_miss" in ln]
    result["kernels_compiled"], result["compile_ms"] = len(compiles), sum(compiles)
    result["tok_per_s"] = result["tokens"] / result["seconds"]
    return result


def model_path(name: str, tmp: str) -> str:
    if name != "tiny":
        return name
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import _save_tiny

    return _save_tiny(os.path.join(tmp, "tiny"), "llama")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--caps", type=int, nargs="+", default=[1024, 64, 32])
    workloads = ["batch", "decode", "steady"]
    ap.add_argument("--workloads", nargs="+", default=workloads[:2], choices=workloads)
    ap.add_argument("--batch-prompts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from benchmarks.cpu_info import cpu_flags

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, tmp)
        for _ in range(args.repeats):
            for workload in args.workloads:
                for cap in args.caps:
                    r = run_one(model, workload, cap, args.batch_prompts)
                    runs.setdefault(f"{workload} cap={cap}", []).append(r)
                    print(f"{workload} cap={cap}: " + json.dumps(r), flush=True)
    summary = {
        key: {
            "tok_per_s_median": statistics.median(r["tok_per_s"] for r in rs),
            "kernels_compiled": [r["kernels_compiled"] for r in rs],
            "compile_share_pct": [round(r["compile_ms"] / 10 / r["seconds"], 2) for r in rs],
            "rss_growth_mb": [round(r["rss_growth_mb"], 1) for r in rs],
            "steps": rs[0]["steps"],
        }
        for key, rs in runs.items()
    }
    result = {
        "date": datetime.date.today().isoformat(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
        "load_avg_end": os.getloadavg(), "model": args.model, "summary": summary,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
