"""Decode speed of every weight format, same run (issues: quantization, 16).

For each weight format on the default model: single-request decode tokens/s (one ~128-token
prompt, greedy; decode time = time of an (n+1)-token run minus a 1-token run), batched decode
throughput at each of `--decode-batches` (that many ~16-token prompts x `--output-len` tokens
submitted at once: output tokens / wall time, mostly decode steps of that many rows) and the
prefill-heavy `--batch`-way throughput (~128-token prompts). All engines are built first and
measured in alternating rounds; each figure is the best of `--rounds` (the machine is
shared: the best round is the least disturbed). Ratios are against fp32 from the same run.

    python benchmarks/bench_quant_speed.py [--formats fp32,int8,int4] [--decode-batches 16,64]
        [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

FORMATS = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "fp8": {"quantization": "fp8"},
}


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def measure(llm: LLM, args) -> dict:
    prompts = make_prompts(llm.tokenizer, args.batch, args.prompt_len, seed=1)
    short = make_prompts(llm.tokenizer, max(args.decode_batches), 16, seed=2, jitter=2)
    _, t1 = _run(llm, prompts[:1], 1)
    n, tn = _run(llm, prompts[:1], args.output_len + 1)
    r = {"single_decode_tok_s": (n - 1) / (tn - t1)}
    for b in args.decode_batches:
        tokens, secs = _run(llm, short[:b], args.output_len)
        r[f"decode_{b}_tok_s"] = tokens / secs
    tokens, secs = _run(llm, prompts, args.output_len)
    r["batch_tok_s"] = tokens / secs
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp32,int8,int4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decode-batches", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.decode_batches = [int(b) for b in args.decode_batches.split(",")]

    names = args.formats.split(",")
    llms = {n: LLM("smollm2-135m", kv_cache_memory="256MiB", **FORMATS[n]) for n in names}
    for llm in llms.values():
        _run(llm, [[1, 2, 3, 4]], 4)  # warm-up
    best: dict[str, dict] = {n: {} for n in names}
    for rnd in range(args.rounds):
        for name, llm in llms.items():
            r = measure(llm, args)
            best[name] = {k: max(v, best[name].get(k, 0.0)) for k, v in r.items()}
            line = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
            print(f"round {rnd + 1} {name:>5}: {line}", flush=True)

    keys = list(next(iter(best.values())))
    base = best.get("fp32", best[names[0]])
    print(f"\n{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # fmt: skip
    heads = ["single-request decode"] + [f"decode x{b}" for b in args.decode_batches] + [f"{args.batch}-way"]
    print("| weights | " + " | ".join(f"{h} tok/s (vs fp32)" for h in heads) + " |")
    print("|---|" + "---|" * len(keys))
    for name in names:
        cells = [f"{best[name][k]:.1f} ({best[name][k] / base[k]:.2f}x)" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "best": best}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
