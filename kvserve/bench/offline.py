"""`kvserve bench offline`: engine throughput with no HTTP in the way, on the same datasets.

Every prompt (as token ids; chat prompts templated) is handed to the in-process `LLM` at once;
the difference from `bench serve` at the same load is what the server layer costs.
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import asdict
from typing import Any

from kvserve.bench.metrics import summary_ms
from kvserve.bench.serve import dataset_config


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    from kvserve.bench.datasets import build_dataset

    knobs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
             "dtype": args.dtype}  # fmt: skip
    llm = LLM(
        args.model, kv_cache_memory=args.kv_cache_memory, **{k: v for k, v in knobs.items() if v is not None}
    )
    if args.tokenizer and args.tokenizer != args.model:
        from kvserve.bench.datasets import load_bench_tokenizer

        tok = load_bench_tokenizer(args.tokenizer)
    else:
        tok = llm.tokenizer
    requests = build_dataset(tok, dataset_config(args))
    params = [
        SamplingParams(
            temperature=args.temperature, max_tokens=r.output_len, ignore_eos=args.ignore_eos, seed=i
        )
        for i, r in enumerate(requests)
    ]
    prompts = [r.prompt_ids for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t0
    in_tok = sum(len(p) for p in prompts)
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [t for o in outs if (t := o.metrics.time_to_first_token) is not None]
    cfg = llm.llm_engine.config
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": args.model,
        "dataset": {k: v for k, v in asdict(dataset_config(args)).items() if k != "extra"},
        # what the run used (defaults resolved), as bench serve's "load": throughput without it
        # cannot be compared or reproduced
        "engine": {
            "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "dtype": cfg.dtype,
            "ignore_eos": args.ignore_eos, "temperature": args.temperature,
        },
        "metrics": {
            "completed": len(outs), "duration_s": duration, "total_input_tokens": in_tok,
            "total_output_tokens": out_tok, "request_throughput": len(outs) / duration,
            "output_throughput": out_tok / duration, "total_token_throughput": (in_tok + out_tok) / duration,
            "ttft_ms": summary_ms(ttfts),
        },
    }  # fmt: skip


def format_offline(res: dict[str, Any]) -> str:
    m = res["metrics"]
    rows = [
        ("Requests", f"{m['completed']:,}"),
        ("Duration (s)", f"{m['duration_s']:,.2f}"),
        ("Total input tokens", f"{m['total_input_tokens']:,}"),
        ("Total output tokens", f"{m['total_output_tokens']:,}"),
        ("Request throughput (req/s)", f"{m['request_throughput']:,.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:,.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_token_throughput']:,.2f}"),
        ("Mean TTFT (ms)", f"{m['ttft_ms']['mean']:,.2f}" if m["ttft_ms"]["mean"] is not None else "-"),
    ]
    lines = [" Offline Engine Throughput ".center(52, "=")]
    lines += [f"{k + ':':<38}{v:>14}" for k, v in rows]
    return "\n".join(lines + ["=" * 52])
