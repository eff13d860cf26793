"""`kvserve bench serve | sweep | offline`: argument parsing and printing, nothing else."""

from __future__ import annotations

import argparse
import sys

from kvserve.argtypes import writable_file
from kvserve.bench.args import add_offline_args, add_serve_args, base_url
from kvserve.bench.vllm_args import (
    SAVE_NAMED,
    add_vllm_serve_args,
    named_result_file,
    resolve_vllm_serve_args,
)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.bench.report import format_table, save_json
    from kvserve.bench.serve import prepare, resolve_model, run_serve

    if args.save_detailed and not args.save_result:  # the timings go into that file only
        print(
            "error: save-detailed: needs --save-result FILE to write the per-request timings to",
            file=sys.stderr,
        )
        return 2
    problem = resolve_vllm_serve_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        resolve_model(args, args.base_url)
        if args.save_result == SAVE_NAMED:
            args.save_result = named_result_file(args)
        tok, requests = prepare(args)
        res = run_serve(args, args.base_url, tok, requests, detailed=args.save_detailed)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res.update(args.metadata or [])  # vLLM's --metadata: top-level keys, as its result files have them
    print(format_table(res))
    if args.save_result:
        save_json(res, args.save_result)
    return _status(res["metrics"]["failed"], res["metrics"].get("interrupted", 0))


def _status(failed: int, interrupted: int) -> int:
    """0: every request answered; 1: some failed; 130 (a shell's Ctrl-C status): the user cut
    the run short, and the report covers the requests that finished."""
    if interrupted:
        print(f"interrupted (Ctrl-C): {interrupted} request(s) did not finish", file=sys.stderr)
        return 130
    return 0 if failed == 0 else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from kvserve.bench.report import save_json
    from kvserve.bench.sweep import plot_sweep, run_sweep

    try:
        res = run_sweep(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot_sweep(res, args.plot, args.title)
    print(f"plot: {args.plot}")
    if args.save_result:
        save_json(res, args.save_result)
    runs = [r["metrics"] for s in res["series"] for r in s["runs"]]
    return _status(sum(m["failed"] for m in runs), sum(m.get("interrupted", 0) for m in runs))


def cmd_offline(args: argparse.Namespace) -> int:
    from kvserve.bench.offline import format_offline, run_offline
    from kvserve.bench.report import save_json

    try:
        res = run_offline(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_offline(res))
    if args.save_result:
        save_json(res, args.save_result)
    return 0


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server (serve, sweep) or the engine (offline)")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="load-test one OpenAI-compatible server")
    add_serve_args(serve)
    serve.add_argument(
        "--save-result", type=writable_file, nargs="?", const=SAVE_NAMED, default=None,
        help="write the result as JSON (docs/BENCH.md); alone, as vLLM's switch: to --result-dir / "
        "--result-filename, or a name from the run",
    )  # fmt: skip
    add_vllm_serve_args(serve)
    serve.add_argument("--save-detailed", action="store_true", help="include per-request timings in JSON")
    serve.set_defaults(func=cmd_serve)

    sweep = sub.add_parser("sweep", help="bench serve over concurrencies or rates, plot the curve")
    sweep.add_argument(
        "--base-url", type=base_url, action="append", required=True, help="repeat to compare servers"
    )
    sweep.add_argument("--label", action="append", help="legend name per --base-url")
    sweep.add_argument("--concurrencies", default=None, help="e.g. 1,8,32 (all prompts sent at once)")
    sweep.add_argument("--rates", default=None, help="requests/s, e.g. 1,2,4,inf")
    sweep.add_argument("--plot", type=writable_file, default="bench_sweep.png", help="PNG path")
    sweep.add_argument("--title", default=None)
    sweep.add_argument("--save-result", type=writable_file, default=None, help="all runs as JSON")
    add_serve_args(sweep, single_url=False)
    sweep.set_defaults(func=cmd_sweep)

    off = sub.add_parser("offline", help="engine throughput in-process (no HTTP)")
    add_offline_args(off)
    off.add_argument("--save-result", type=writable_file, default=None)
    off.set_defaults(func=cmd_offline)
