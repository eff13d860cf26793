"""`kvserve plan`: argparse wiring only; the arithmetic lives in plan.py.

The main CLI calls `register(subparsers)`; `python -m kvserve.planner.cli` runs
the same subcommand on its own.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.argtypes import at_most, max_model_len, non_negative_float, positive_int
from kvserve.core.block_size import gpu_block_size_problem
from kvserve.planner import simulate_cli
from kvserve.planner.gpus import DEFAULT_GPU, GPUS
from kvserve.planner.plan import WEIGHT_BYTES, PlanRequest, make_plan
from kvserve.planner.presets import PRESETS
from kvserve.planner.report import render_table, to_dict
from kvserve.planner.shares import HELD_SHARE, SHARE, USED_SHARE


def _plan_dtype(text: str) -> str:
    """vLLM's `--dtype auto` (was "invalid choice"): the plan's default, bf16. vLLM's auto runs a
    checkpoint in 16 bits (bf16, or fp16 for an fp32 or fp16 one: the same bytes)."""
    return "bf16" if text.strip().lower() == "auto" else text


def gpu_block_size(text: str) -> int:
    """A block size the GPU engine starts with (the engine's own rule)."""
    size = positive_int(text)
    if problem := gpu_block_size_problem(size):
        raise argparse.ArgumentTypeError(f"{problem}: the GPU engine refuses another")
    return size


# Far past any real deployment, so a value above is a typo (1e300 for 1e3); unbounded, the table
# printed bills, replica and GPU counts of hundreds of digits (or "$inf"), and a float division
# gave 10^24 sequences "499999999999999991611392 replicas".
MAX_TOKENS_PER_DAY = 1e15  # a quadrillion: more than the largest API providers serve in a day
MAX_PRICE = 10_000.0  # USD per GPU-hour, or per 1M API tokens
MAX_GPUS = 1_000_000  # more than any one cluster holds
MAX_CONCURRENCY = 10_000_000  # sequences at once
TOKENS_PER_DAY = at_most(non_negative_float, MAX_TOKENS_PER_DAY, "a quadrillion tokens a day")
PRICE = at_most(non_negative_float, MAX_PRICE, "USD")
NUM_GPUS = at_most(positive_int, MAX_GPUS, "a million GPUs")
CONCURRENCY = at_most(positive_int, MAX_CONCURRENCY, "ten million sequences at once")

DTYPES = sorted(set(WEIGHT_BYTES) | {"float32", "float16", "bfloat16"})
# kvserve's names and vLLM's (fp8_e4m3 is kvserve's fp8; vLLM's fp8 is e4m3 too)
KV_CACHE_DTYPES = ["auto", "fp32", "fp16", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        help=f"preset ({', '.join(PRESETS)}), HF model dir with config.json, or .gguf file",
    )
    hw = p.add_argument_group("hardware")
    hw.add_argument(
        "--gpu", help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU}; none with --kv-cache-memory)"
    )
    hw.add_argument("--num-gpus", type=NUM_GPUS, help="GPUs you have; default: as many as the plan needs")
    for flags, what in ((("--tensor-parallel-size", "-tp"), "GPUs a replica's layers split over"),
                        (("--pipeline-parallel-size", "-pp"), "a replica's pipeline stages")):  # fmt: skip
        hw.add_argument(*flags, type=NUM_GPUS, default=None,
                        help=f"as vLLM's: {what} (default: the smallest layout that fits)")  # fmt: skip
    hw.add_argument(
        "--gpu-memory-utilization", type=USED_SHARE, default=0.9, help="share of GPU memory used (0.9)"
    )
    hw.add_argument(
        "--overhead",
        type=HELD_SHARE,
        default=0.3,
        help="share of the memory left after weights held back for activations, CUDA graphs and "
        "fragmentation; the rest is KV cache (default 30%%)",
    )
    prec = p.add_argument_group("precision")
    prec.add_argument(
        "--dtype", type=_plan_dtype, default="bf16", choices=DTYPES,
        help="compute dtype; fp8/int8/int4 = quantised; auto (vLLM's default): bf16",
    )  # fmt: skip
    prec.add_argument("--quantization", choices=["fp8", "int8", "int4"], help="weight format")
    prec.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache element type (auto = the compute dtype; fp8 and vLLM's fp8_e4m3 are kvserve's "
        "fp8 cache, with a scale per token and head; fp8_e5m2 is vLLM's, 1 byte with none)",
    )
    kv = p.add_argument_group("KV cache and load")
    kv.add_argument(
        "--max-model-len",
        type=max_model_len,
        help="prompt + output limit in tokens (4096, 4k, 4K = 4,096; -1 or auto, the default: model context)",
    )
    kv.add_argument(
        "--concurrency", type=CONCURRENCY, default=1, help="sequences of max-model-len to serve at once"
    )
    kv.add_argument(
        "--kv-cache-memory", help='fixed KV budget per GPU, e.g. "2GiB": shows the pool the engine allocates'
    )
    kv.add_argument(
        "--block-size", type=gpu_block_size, default=16, help="tokens per KV block (16; a power of two >= 16)"
    )
    kv.add_argument(
        "--context-len",
        type=positive_int,
        help="average context per decoding sequence (min(2048, max-model-len))",
    )
    kv.add_argument(
        "--max-num-seqs", type=positive_int, default=256, help="scheduler cap on the decode batch (256)"
    )
    cost = p.add_argument_group("cost (USD)")
    cost.add_argument("--price-per-hour", type=PRICE, help="per GPU-hour (default: catalogue price)")
    cost.add_argument("--api-price-in", type=PRICE, help="API price per 1M input tokens")
    cost.add_argument("--api-price-out", type=PRICE, help="API price per 1M output tokens")
    cost.add_argument("--tokens-per-day", type=TOKENS_PER_DAY, help="expected input+output tokens per day")
    cost.add_argument(
        "--input-share",
        type=SHARE,
        default=0.75,
        help="input share of all tokens, for blended prices and capacity (default 0.75 = 3 in : 1 out)",
    )
    cost.add_argument(
        "--utilization",
        type=USED_SHARE,
        default=0.5,
        help="average busy share of the saturated throughput; capacity = saturated tokens/s x 86400 x this "
        "(default 0.5)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    simulate_cli.add_arguments(p)


# Options of one mode only (--max-num-seqs and --json are shared): given in the other mode they
# were silently ignored (a model and --gpu did not change a --simulate run at all).
PLAN_ONLY = (
    "gpu", "num_gpus", "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
    "overhead", "dtype", "quantization", "kv_cache_dtype",
    "max_model_len", "concurrency", "kv_cache_memory", "block_size", "context_len", "price_per_hour",
    "api_price_in", "api_price_out", "tokens_per_day", "input_share", "utilization",
)  # fmt: skip
SIMULATE_ONLY = (
    "step_overhead_ms", "token_ms", "decode_token_ms", "max_num_batched_tokens", "min_replicas",
    "max_replicas", "target_saturation", "scale_interval", "cold_start", "scale_down_delay", "slo_ttft",
    "slo_target",
)  # fmt: skip


def _set_options(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    """The flags among `dests` given a value other than their default."""
    defaults = argparse.ArgumentParser()
    _add_arguments(defaults)
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) != defaults.get_default(d)]


def _mode_error(args: argparse.Namespace) -> str | None:
    if args.simulate:
        extra = (["MODEL"] if args.model else []) + _set_options(args, PLAN_ONLY)
        if extra:
            return (
                f"{', '.join(extra)}: not used by --simulate (a replica is modelled by its step times: "
                "--step-overhead-ms, --token-ms, --decode-token-ms); run the sizing plan separately"
            )
    elif extra := _set_options(args, SIMULATE_ONLY):
        return f"{', '.join(extra)}: only used with --simulate TRACE"
    return None


def run(args: argparse.Namespace) -> int:
    """Make the plan and print it; exit 1 when the model does not fit, 2 on bad input."""
    problem = _mode_error(args)
    if problem:
        print(f"kvserve plan: error: {problem}", file=sys.stderr)
        return 2
    if args.simulate:
        return simulate_cli.run(args)
    if args.model is None:
        print("kvserve plan: error: MODEL is required (or --simulate TRACE)", file=sys.stderr)
        return 2
    fields = set(PlanRequest.__dataclass_fields__)
    request = PlanRequest(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        plan = make_plan(request)
    except ValueError as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_dict(plan), indent=2))
    else:
        print(render_table(plan), end="")
    return 0 if plan.memory.fits and (plan.layout is None or plan.layout.fits) else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `plan` to a CLI's subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="GPU sizing and self-host cost for a model",
        description="Size a model for serving: memory, KV pool, parallel layout, roofline decode "
        "throughput (an estimate) and cost against an API. See docs/PLAN.md.",
    )
    _add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
