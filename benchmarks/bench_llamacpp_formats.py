"""Optional (issue 16): llama.cpp's own quantized-vs-fp32 speed on this machine, beside kvserve's.

Issue 16 asks the quantized server for 2x fp32's throughput at 32 streams, a compute-bound load.
This asks what the field's CPU kernels reach on the same machine: llama.cpp's `llama-bench` on
the default model's GGUF (Q4_1 as shipped) and on copies `llama-quantize` makes of it (F32,
Q8_0, Q4_0: llama.cpp repacks Q4_0 for its AVX2 / AVX-512 GEMMs), at prompt processing of
`--prompt` tokens (batched: compute-bound) and generation (one token at a time: bandwidth-bound).
In the same run, kvserve's offline engine on the same shapes: one `--prompt`-token prefill
(max_tokens=1, best of 3) and per-token decode (bench_cpu_serve.py's yardstick), per
configuration. Every figure is printed as tokens/s and as a ratio to its engine's fp32.

llama.cpp is never a dependency: build `llama-bench` and `llama-quantize` from its source (for
example the `vendor/llama.cpp` tree of `pip download --no-binary :all: llama-cpp-python`, cmake
`-DGGML_NATIVE=ON -DLLAMA_CURL=OFF`) and name the build's bin folder.

    python benchmarks/bench_llamacpp_formats.py --llama-bin BUILD/bin [--threads 2] [--prompt 512]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_cpu_serve import MODEL, _engine_kwargs, config_flags, offline_ms_per_token  # noqa: E402
from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.loader import resolve_model  # noqa: E402

LLAMA_TYPES = ["F32", "Q8_0", "Q4_0"]  # made with llama-quantize; Q4_1 is the shipped file


def llama_bench(binary: str, gguf: str, args: argparse.Namespace) -> tuple[float, float]:
    """(prompt-processing tok/s, generation tok/s): llama-bench's averages over `args.reps`."""
    cmd = [binary, "-m", gguf, "-t", str(args.threads), "-p", str(args.prompt), "-n", str(args.gen),
           "-r", str(args.reps), "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return pp, tg


def kvserve_prefill_tok_s(flags: list[str], prompt: int, rounds: int = 3) -> float:
    """One `prompt`-token prefill (max_tokens=1, prefix caching off), best of `rounds`."""
    from kvserve import LLM, SamplingParams

    llm = LLM(MODEL, kv_cache_memory="256MiB", enable_prefix_caching=False, **_engine_kwargs(flags))
    params = SamplingParams(temperature=0, max_tokens=1)
    best = float("inf")
    for seed in range(rounds + 1):  # the first is a warm-up
        ids = make_prompts(llm.tokenizer, 1, prompt, seed=seed, jitter=0)
        t = time.perf_counter()
        llm.generate(ids, params, use_tqdm=False)
        if seed:
            best = min(best, time.perf_counter() - t)
    del llm
    gc.collect()
    return prompt / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", required=True, help="folder with llama-bench and llama-quantize")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="fp32,int4,int8", help="kvserve configurations (bench_cpu_serve.py)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# CPU flags: {cpu_flags()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    source = resolve_model(MODEL)
    if source.kind != "gguf":
        ap.error(f"{MODEL} did not resolve to a GGUF file: {source}")
    shipped = source.path
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for t in LLAMA_TYPES:
            files[t] = os.path.join(tmp, f"model-{t}.gguf")
            cmd = [os.path.join(args.llama_bin, "llama-quantize"), "--allow-requantize", shipped, files[t], t]
            subprocess.run(cmd, check=True, capture_output=True)
        files["Q4_1"] = shipped
        for t in ["F32", "Q8_0", "Q4_0", "Q4_1"]:
            pp, tg = llama_bench(os.path.join(args.llama_bin, "llama-bench"), files[t], args)
            rows.append((f"llama.cpp {t}", pp, tg))
            print(f"#   llama.cpp {t}: pp{args.prompt} {pp:.1f}, tg{args.gen} {tg:.1f} tok/s", flush=True)
    for name in args.configs.split(","):
        flags = config_flags(name)
        pp = kvserve_prefill_tok_s(flags, args.prompt)
        gc.collect()
        tg = 1000 / offline_ms_per_token(flags, args.gen, args.reps)
        rows.append((f"kvserve {name}", pp, tg))
        print(f"#   kvserve {name}: prefill {args.prompt} {pp:.1f} tok/s, decode {tg:.1f} tok/s", flush=True)
    fp32 = {"llama.cpp": rows[0], "kvserve": next((r for r in rows if r[0] == "kvserve fp32"), None)}
    print(f"\n| engine, weights | prompt {args.prompt} tok/s (vs its fp32) | generation tok/s (vs fp32) |")
    print("|---|---|---|")
    for label, pp, tg in rows:
        ref = fp32[label.split()[0]]
        pairs = zip((pp, tg), (ref or rows[0])[1:])
        cells = [f"{v:.1f}" + (f" ({v / r:.2f}x)" if ref else "") for v, r in pairs]
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
