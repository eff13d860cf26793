"""Engine RSS against what it must hold: weights + KV pool + 400 MB (issue 16, memory).

Each measurement runs in a fresh child process (RSS is per process and never shrinks much),
which builds the offline engine for the default model with a 1 GiB KV pool, runs a few
requests (so oneDNN's kernel caches and the allocator are warm), and reports from
/proc/self/status:
- runtime: RSS after `import torch, kvserve` (interpreter, libraries), before any engine;
- weights: `model.weight_bytes()` (each weight once, as held: packed or plain) plus
  `model.duplicate_weight_bytes()` (a tied table kept both packed, for the lm_head, and plain,
  for lookups);
- KV pool: the pool tensor(s);
- rest: RSS minus all of the above (allocator, kernel caches, tokenizer, step buffers).
`--baseline-tree DIR` also measures another checkout (e.g. `git archive` of the previous
commit) in the same run and prints the ratio.

    python benchmarks/bench_memory.py [--dtype float32] [--quantization int4] [--kv-cache-dtype int8]
        [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(args) -> dict:
    import torch  # noqa: F401

    from kvserve import LLM, SamplingParams

    runtime = _status()["VmRSS"]
    quant = {"quantization": args.quantization} if args.quantization else {}
    kv = {"kv_cache_memory": args.kv_cache_memory, "kv_cache_dtype": args.kv_cache_dtype}
    llm = LLM(args.model, dtype=args.dtype, **kv, **quant)
    loaded = _status()
    prompts = [[1] + list(range(100 + 7 * i, 164 + 7 * i)) for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    warm = _status()
    runner = llm.llm_engine.model_runner
    model = runner.model
    dup = model.duplicate_weight_bytes() if hasattr(model, "duplicate_weight_bytes") else None
    kv = sum(t.numel() * t.element_size() for t in (runner.kv_cache, runner.kv_scales) if t is not None)
    return {"runtime": runtime, "loaded": loaded, "warm": warm, "weights": model.weight_bytes(),
            "duplicate": dup, "kv": kv}  # fmt: skip


def run(tree: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--dtype", args.dtype,
           "--kv-cache-memory", args.kv_cache_memory, "--kv-cache-dtype", args.kv_cache_dtype]  # fmt: skip
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(name: str, r: dict) -> int:
    w, dup, kv, rss = r["weights"], r["duplicate"], r["kv"], r["warm"]["VmRSS"]
    held = w + (dup or 0)
    rest = rss - r["runtime"] - held - kv
    target = w + kv + 400 * MiB
    print(f"\n{name}:")
    print(f"  runtime (after import)   {r['runtime'] / MiB:8.1f} MiB")
    print(f"  weights (each once)      {w / MiB:8.1f} MiB")
    if dup is None:
        print("  duplicate copies         (not reported by this tree: its packed copies are held "
              "beside every plain weight)")  # fmt: skip
    else:
        print(f"  duplicate copies         {dup / MiB:8.1f} MiB")
    print(f"  KV pool                  {kv / MiB:8.1f} MiB")
    print(f"  rest                     {rest / MiB:8.1f} MiB")
    print(f"  RSS (warm)               {rss / MiB:8.1f} MiB  (anon {r['warm']['RssAnon'] / MiB:.1f}, "
          f"file {r['warm']['RssFile'] / MiB:.1f}; after load {r['loaded']['VmRSS'] / MiB:.1f}; "
          f"peak {r['warm']['VmHWM'] / MiB:.1f})")  # fmt: skip
    ok = "meets" if rss <= target else "misses"
    print(f"  target weights + KV + 400 MiB = {target / MiB:.1f} MiB: {ok} it "
          f"(RSS - weights - KV = {(rss - w - kv) / MiB:.1f} MiB)")  # fmt: skip
    return rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--quantization", default=None, help="e.g. int4 (what `make serve` runs)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. int8 (what `make serve` runs)")
    ap.add_argument("--baseline-tree", default=None, help="another checkout to measure in the same run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    sys.path.insert(0, ROOT)
    from benchmarks.common import machine
    from benchmarks.cpu_info import cpu_flags

    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}")
    quant = f", quantization {args.quantization}" if args.quantization else ""
    kv = f"KV pool {args.kv_cache_memory} ({args.kv_cache_dtype})"
    print(f"model {args.model}, dtype {args.dtype}{quant}, {kv}")
    this = report(f"this tree ({ROOT})", run(ROOT, args))
    if args.baseline_tree:
        base = report(f"baseline tree ({args.baseline_tree})", run(args.baseline_tree, args))
        print(f"\nRSS this / baseline: {this / base:.2f}x ({(base - this) / MiB:.0f} MiB less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
