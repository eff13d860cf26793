"""`kvserve plan --simulate TRACE`: the flags, the run and its report (the model is in
simulate.py, traces in trace.py; docs/PLAN.md)."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.argtypes import non_negative_float, positive_float, positive_int
from kvserve.planner.shares import USED_SHARE
from kvserve.planner.sim_limits import check_replicas, check_trace
from kvserve.planner.simulate import (
    ReplicaModel,
    Result,
    ScalingPolicy,
    min_replicas_for_slo,
    quantile,
    simulate,
)
from kvserve.planner.trace import load_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Finite numbers only: NaN step times simulated 0 tokens/s and an infinite one never ended.
    s = p.add_argument_group("autoscaling simulation (--simulate; docs/PLAN.md)")
    s.add_argument(
        "--simulate",
        metavar="TRACE",
        help="JSONL trace ({t, prompt_tokens, output_tokens} a line) or bursty[:k=v,...]",
    )
    s.add_argument(
        "--step-overhead-ms", type=non_negative_float, default=20.0, help="per engine step, measured (20)"
    )
    s.add_argument(
        "--token-ms", type=non_negative_float, default=0.2, help="per prompt token computed in a step (0.2)"
    )
    s.add_argument("--decode-token-ms", type=non_negative_float, default=None,
                   help="per decoding sequence in a step, measured (default: --token-ms)")  # fmt: skip
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="tokens per step (2048)")
    s.add_argument("--min-replicas", type=positive_int, default=1)
    s.add_argument("--max-replicas", type=positive_int, default=8)
    s.add_argument(
        "--target-saturation", type=positive_float, default=0.8, help="the HPA's kvserve:saturation target"
    )
    s.add_argument(
        "--scale-interval", type=positive_float, default=15.0, help="seconds between autoscaler decisions"
    )
    s.add_argument(
        "--cold-start", type=non_negative_float, default=60.0, help="seconds from scale-up to serving"
    )
    s.add_argument(
        "--scale-down-delay", type=non_negative_float, default=300.0, help="stabilization window (s)"
    )
    s.add_argument("--slo-ttft", type=positive_float, default=2.0, help="time-to-first-token SLO in seconds")
    s.add_argument("--slo-target", type=USED_SHARE, default=0.99, help="share of requests that must meet it")
    # --max-num-seqs and --json are shared with the sizing plan


def _row(res: Result, slo: float) -> dict:
    return {
        "requests": res.requests,
        "ttft_p50_s": round(quantile(res.ttft_s, 0.5), 3),
        "ttft_p95_s": round(quantile(res.ttft_s, 0.95), 3),
        "ttft_p99_s": round(quantile(res.ttft_s, 0.99), 3),
        "queue_mean_s": round(sum(res.queue_s) / max(1, len(res.queue_s)), 3),
        "queue_p95_s": round(quantile(res.queue_s, 0.95), 3),
        "slo_attainment": round(res.attainment(slo), 4),
        "replica_hours": round(res.replica_hours, 3),
        "peak_replicas": res.peak_replicas,
        "scale_events": res.scale_events,
        "output_tokens_per_s": round(res.output_tokens_per_s, 1),
    }


def run(args: argparse.Namespace) -> int:
    """Exit 0 when the policy meets the SLO target, 1 when not, 2 on bad input."""
    try:
        if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
        decode_ms = args.token_ms if args.decode_token_ms is None else args.decode_token_ms
        times = (args.step_overhead_ms, args.token_ms, decode_ms, args.cold_start)
        if min(times) < 0 or args.scale_interval <= 0:
            raise ValueError("times must be >= 0 (--scale-interval > 0)")
        if not 0 < args.target_saturation or not 0 < args.slo_target <= 1:
            raise ValueError("--target-saturation must be > 0 and --slo-target in (0, 1]")
        check_replicas(args.min_replicas, args.max_replicas)
        trace = load_trace(args.simulate)
        check_trace(trace, args.scale_interval)
        model = ReplicaModel(args.max_num_seqs, args.max_num_batched_tokens, args.step_overhead_ms / 1000,
                             args.token_ms / 1000, decode_ms / 1000)  # fmt: skip
        policy = ScalingPolicy(args.min_replicas, args.max_replicas, args.target_saturation,
                               args.scale_interval, args.cold_start, args.scale_down_delay)  # fmt: skip
        res = simulate(trace, model, policy)
        fixed, auto = min_replicas_for_slo(trace, model, policy, args.slo_ttft, args.slo_target)
        one = simulate(trace, model, ScalingPolicy(1, 1))  # a runaway run is refused here too
    except ValueError as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    out = {
        "policy": _row(res, args.slo_ttft),
        "min_fixed_replicas_for_slo": fixed,
        "min_replicas_for_slo_with_autoscaling": auto,
        "one_replica_output_tokens_per_s": round(one.output_tokens_per_s, 1),
        "slo": {"ttft_s": args.slo_ttft, "target": args.slo_target},
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"simulated {res.requests} requests, replicas {args.min_replicas}-{args.max_replicas}, "
              f"target saturation {args.target_saturation:g}, cold start {args.cold_start:g} s")  # fmt: skip
        for k, v in out["policy"].items():
            print(f"  {k:<22} {v}")
        slo = f"TTFT <= {args.slo_ttft:g} s for {args.slo_target:.0%}"
        print(f"fewest fixed replicas for {slo}: {fixed if fixed is not None else 'more than max'}")
        print(f"fewest min replicas with autoscaling: {auto if auto is not None else 'more than max'}")
        tps = out["one_replica_output_tokens_per_s"]
        print(f"one replica's throughput on this trace: {tps} output tokens/s")
    return 0 if res.attainment(args.slo_ttft) >= args.slo_target else 1
