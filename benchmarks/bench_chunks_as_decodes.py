"""Prompt chunks as decode rows against SDPA chunks (ModelRunner._stack_takes_chunks).

Where the C++ decode stack runs the model (int4 / int8 weights), every prompt chunk runs whole
in the stack, every prompt token a decode row (the same arithmetic as a decode: batch
invariance); the other path runs the layers in Python with SDPA per chunk. With float32
weights and a 1-byte cache (`--weights float32`, since round 43) the layers run in Python either
way and the prompt rows go through the paged decode kernel instead of SDPA. Both paths run in
one process, the backend's switch flipped between them (the machine is shared: an
alternating A/B in one run is the only fair comparison):
1. chunks: one `--prompt-len` prompt prefilled in chunks of each of `--chunks` tokens, the
   two paths alternating per prompt for `--rounds` rounds; the best time of each for the
   chunks starting at 0, 1/4, 1/2 and 3/4 of the prompt, with their attended pairs;
2. c=32: bench_cpu_serve's load offline (64 requests of ~100 prompt tokens and 128 output
   tokens, 32 at a time, `--long-prefill-token-threshold 64`), the path switching every step;
   the steps that carry a 56-72-token chunk, median and mean per path, and the pure-decode
   steps as a control (the same path both ways).

    python benchmarks/bench_chunks_as_decodes.py [--chunks 16,64,256] [--prompt-len 1024] [--rounds 4]
        [--weights int4|int8|float32|bfloat16] [--kv-cache-dtype int8|fp8_e4m3|auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_cpu_serve import MODEL  # noqa: E402
from benchmarks.common import make_prompts, run_header  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

ON, OFF = True, False  # every chunk as decode rows / none
ENGINE = {"quantization": "int4", "kv_cache_dtype": "int8", "enable_prefix_caching": False}  # main() sets


def attended_pairs(start: int, n: int) -> int:
    """(query, key) pairs a chunk of n tokens after `start` covers: each new row sees its own
    position and every one before it."""
    return n * start + n * (n + 1) // 2


def timed_steps(llm: LLM, record) -> None:
    """Wrap the executor so each step's scheduled work and wall time go to record(sched, s)."""
    core = llm.llm_engine.core
    run = core.executor.execute_model

    def timed(sched, tables):
        t0 = time.perf_counter()
        out = run(sched, tables)
        record(sched, time.perf_counter() - t0)
        return out

    core.executor.execute_model = timed


def chunk_times(chunk: int, prompt_len: int, rounds: int) -> None:
    llm = LLM(MODEL, kv_cache_memory="512MiB", max_num_batched_tokens=chunk, **ENGINE)
    backend = llm.llm_engine.model_runner.attn_backend
    prompt = make_prompts(llm.tokenizer, 1, prompt_len, seed=5, jitter=0)[0]
    best: dict[tuple[bool, int, int], float] = {}
    mode = [OFF]

    def record(sched, s):
        req, n = sched.scheduled[0]
        if n > 1:
            key = (mode[0], req.num_computed_tokens, n)
            best[key] = min(best.get(key, s), s)

    timed_steps(llm, record)
    for rnd in range(rounds):
        for path in (OFF, ON) if rnd % 2 == 0 else (ON, OFF):
            mode[0] = backend.prompt_rows_as_decodes = path
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    every = max(chunk, prompt_len // 4)  # four rows a chunk size: contexts 0 to 3/4 of the prompt
    for _, start, n in sorted(k for k in best if k[0] == OFF and k[1] % every == 0):
        sdpa, rows = best[(OFF, start, n)], best[(ON, start, n)]
        pairs = attended_pairs(start, n)
        ms = f"{sdpa * 1e3:.1f} | {rows * 1e3:.1f}"
        print(f"| {n} | {start} | {pairs} | {ms} | {rows / sdpa:.2f}x |", flush=True)
    del llm


def c32_steps(rounds: int) -> None:
    llm = LLM(MODEL, kv_cache_memory="1GiB", long_prefill_token_threshold=64, **ENGINE)
    backend = llm.llm_engine.model_runner.attn_backend
    prompts = make_prompts(llm.tokenizer, 64, 100, seed=1)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    times: dict[tuple[bool, str], list[float]] = {}
    count = [0]

    def record(sched, s):
        prefill = sum(n for _, n in sched.scheduled if n > 1)
        kind = "chunk" if 56 <= prefill <= 72 else "decode" if prefill == 0 else "other"
        times.setdefault((backend.prompt_rows_as_decodes, kind), []).append(s)
        count[0] += 1
        backend.prompt_rows_as_decodes = ON if count[0] % 2 else OFF  # the next step's path

    timed_steps(llm, record)
    engine = llm.llm_engine
    for rnd in range(rounds):
        sent = live = 0
        while sent < len(prompts) or engine.has_unfinished_requests():
            while live < 32 and sent < len(prompts):
                engine.add_request(f"{rnd}-{sent}", prompts[sent], params)
                sent, live = sent + 1, live + 1
            live -= sum(o.finished for o in engine.step())
    for kind in ("chunk", "decode"):
        a, b = times.get((OFF, kind), []), times.get((ON, kind), [])
        if a and b:
            ma, mb = statistics.median(a), statistics.median(b)
            stat = lambda x: f"{statistics.median(x) * 1e3:.1f} / {statistics.mean(x) * 1e3:.1f}"  # noqa: E731
            ms = f"{stat(a)} | {stat(b)}"
            print(f"| {kind} | {len(a)} / {len(b)} | {ms} | {mb / ma:.2f}x |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="16,64,256", help="chunk sizes (max_num_batched_tokens) to time")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--c32-rounds", type=int, default=3, help="passes of the c=32 load (0: skip it)")
    ap.add_argument(
        "--weights",
        choices=("int4", "int8", "float32", "bfloat16"),
        default="int4",
        help="float32: the float model with a 1-byte cache, laid out the same way since round 43; "
        "bfloat16 (with --kv-cache-dtype auto): what a bf16 cache's prompt rows would cost so",
    )
    ap.add_argument("--kv-cache-dtype", choices=("int8", "fp8_e4m3", "auto"), default="int8")
    args = ap.parse_args()
    floats = {"float32": "float32", "bfloat16": "bfloat16"}
    ENGINE.update(quantization=None if args.weights in floats else args.weights,
                  dtype=floats.get(args.weights, "auto"), kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    print(run_header())
    print(f"default model, {args.weights} weights, {args.kv_cache_dtype} KV; the engine lays every prompt "
          "chunk out as decode rows\n")  # fmt: skip
    print("| chunk | cached before | attended pairs | SDPA ms (best) | as decode rows ms (best) | ratio |")
    print("|---|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        chunk_times(chunk, args.prompt_len, args.rounds)
    if args.c32_rounds:
        print(
            "\n| c=32 steps | count SDPA / rows | SDPA ms median / mean | as decode rows ms median / mean "
            "| ratio |"
        )
        print("|---|---|---|---|---|")
        c32_steps(args.c32_rounds)
    print(f"\nload {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
