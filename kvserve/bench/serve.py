"""`kvserve bench serve`: one load-generator run against one server, from CLI options to result."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
from dataclasses import asdict
from typing import Any

from kvserve.bench.datasets import BenchRequest, DatasetConfig, build_dataset, load_bench_tokenizer
from kvserve.bench.loadgen import LoadConfig, run_load
from kvserve.bench.metrics import compute_metrics
from kvserve.bench.served_model import served_model
from kvserve.bench.server_stats import scrape_spec_counters, spec_decode_summary
from kvserve.bench.slo import parse_slo
from kvserve.bench.vllm_keys import vllm_keys


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prefix_groups=args.num_prefix_groups,
        path=args.dataset_path, seed=args.seed,
    )  # fmt: skip


def load_config(args: argparse.Namespace, base_url: str) -> LoadConfig:
    extra = args.extra_body or {}  # parsed and checked by argtypes.json_object
    return LoadConfig(
        base_url=base_url, model=args.model, endpoint=args.endpoint, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, prompt_format=args.prompt_format, api_key=args.api_key,
        seed=args.seed, extra_body=extra, progress=not args.disable_tqdm,
    )  # fmt: skip


def resolve_model(args: argparse.Namespace, base_url: str) -> None:
    """Without --model, the name the server serves (and its root, a tokenizer to try)."""
    if args.model is None:
        served = served_model(base_url, args.api_key)
        args.model, args.model_root = served.id, served.root


def _tokenizer(args: argparse.Namespace) -> Any:
    """--tokenizer; else --model, then the served model's root (a server's alias is no local
    model, but what it was loaded from may be)."""
    if args.tokenizer:
        return load_bench_tokenizer(args.tokenizer)
    root = getattr(args, "model_root", None)
    try:
        return load_bench_tokenizer(args.model)
    except FileNotFoundError:
        if not root or root == args.model:
            raise
    return load_bench_tokenizer(root)


def prepare(args: argparse.Namespace) -> tuple[Any, list[BenchRequest]]:
    """The tokenizer and the dataset (built once, reused by every run of a sweep)."""
    try:
        tok = _tokenizer(args)
    except FileNotFoundError as e:
        if args.tokenizer:  # the loader's message starts "model:", a flag of its own here
            raise FileNotFoundError(f"tokenizer: {str(e).partition(': ')[2]}") from e
        # --model is the name the server answers to, which often is no local model: say which
        # flag names the tokenizer, rather than only that "model" was not found
        raise FileNotFoundError(
            f"tokenizer: --model {args.model!r} is no local model (alias, .gguf file or Hugging Face "
            "directory) to build the prompts with; pass --tokenizer"
        ) from e
    return tok, build_dataset(tok, dataset_config(args))


def run_serve(
    args: argparse.Namespace, base_url: str, tok: Any, requests: list[BenchRequest], detailed: bool = False
) -> dict[str, Any]:
    cfg = load_config(args, base_url)
    slo = parse_slo(args.slo)
    if cfg.prompt_format == "ids" and cfg.endpoint == "chat":
        raise ValueError("prompt-format: ids only works with the completions endpoint")
    spec_before = scrape_spec_counters(base_url, cfg.api_key)
    results, duration = asyncio.run(
        run_load(cfg, requests, lambda s: len(tok.encode(s, add_special_tokens=False)), args.warmup)
    )
    spec = spec_decode_summary(spec_before, scrape_spec_counters(base_url, cfg.api_key))
    out: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "base_url": base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "dataset": {k: v for k, v in asdict(dataset_config(args)).items() if k != "extra"},
        "load": {
            "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "warmup": args.warmup,
            "ignore_eos": cfg.ignore_eos,
            "temperature": cfg.temperature,
            "prompt_format": cfg.prompt_format,
        },  # fmt: skip
        "metrics": compute_metrics(results, duration, slo),
    }
    asked = getattr(args, "percentile_metrics", None), getattr(args, "metric_percentiles", None)
    out.update(vllm_keys(results, out["metrics"], out["load"], args.model, detailed, *asked))
    if spec is not None:
        out["spec_decode"] = spec
    if detailed:
        out["requests"] = [
            {
                "success": r.success,
                "error": r.error,
                "prompt_len": r.prompt_len,
                "output_tokens": r.output_tokens,
                "start_s": r.start,
                "ttft_s": r.ttft,
                "latency_s": r.latency,
                "itl_s": r.itl,
            }  # fmt: skip
            for r in results
        ]
    return out
