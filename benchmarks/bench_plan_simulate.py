"""The autoscaling simulator against a measured run (issue 21's acceptance): on a bursty trace,
`kvserve plan --simulate`'s one-replica throughput within 20% of `kvserve bench serve`
replaying the same trace against `kvserve serve` on this machine, and the simulator's fewest
replicas for a TTFT SLO.

1. Calibrate the replica model offline (benchmarks/plan_calibrate.py: decode steps at several
   batch sizes, prefills of several lengths, in-process engine, same engine settings): the
   simulator's step overhead, per decoding sequence and per prompt token costs. Nothing of
   the measured run below goes into the model.
2. Simulate one replica on the trace (and, for comparison, the model with one per-token cost,
   the prefill one, as the simulator had before decode was priced apart).
3. Start `kvserve serve` (same settings, one torch thread like the calibration: the 2 cores
   are shared, and spinning OpenMP threads on a busy core cost more than they gain), time its
   start-up (the simulator's cold start), replay the trace with `kvserve bench serve
   --dataset trace --ignore-eos`, and compare output throughput and TTFT p50.
4. The fewest fixed replicas, and the fewest min replicas under the autoscaler, meeting the
   TTFT SLO on the trace, with the measured cold start.

The trace ends in a burst, so the measured run ends with a backlog: its throughput is bounded
by the replica's capacity, not by the arrivals (the offered rate is printed beside it).

    PYTHONPATH=. python benchmarks/bench_plan_simulate.py [--trace bursty:...] [--slo-ttft 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks.cpu_info import cpu_flags  # noqa: E402
from benchmarks.plan_calibrate import calibrate  # noqa: E402
from kvserve.planner.simulate import (  # noqa: E402
    ReplicaModel,
    ScalingPolicy,
    min_replicas_for_slo,
    quantile,
    simulate,
)
from kvserve.planner.trace import load_trace  # noqa: E402

TRACE = "bursty:duration=100,rate=0.2,burst_rate=2.5,burst_every=45,burst_len=10,prompt=128,output=48,seed=7"


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def start_server(args, port: int, log_path: str) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", args.model, "--port", str(port),
           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--disable-web-ui"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("kvserve serve not ready after 600 s")


def bench(args, port: int, trace_path: str, out_path: str) -> dict:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}", "--model", args.model, "--dataset", "trace",
           "--dataset-path", trace_path, "--ignore-eos", "--disable-tqdm",
           "--save-result", out_path]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=3600)
    with open(out_path) as f:
        return json.load(f)["metrics"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--trace", default=TRACE, help="JSONL trace or bursty:... spec")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="TTFT SLO, seconds")
    p.add_argument("--slo-target", type=float, default=0.9, help="share of requests meeting it")
    p.add_argument("--port", type=int, default=8431)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)  # as the server below (OMP_NUM_THREADS=1)
    now = datetime.datetime.now(datetime.UTC)
    print(f"date {now:%Y-%m-%d %H:%M} UTC; cpu flags: {cpu_flags()}; {os.cpu_count()} cores; "
          f"torch {torch.__version__}, 1 thread; load average {loadavg()}")  # fmt: skip
    trace = load_trace(args.trace)
    out_tokens = sum(a.output_tokens for a in trace)
    span = trace[-1].t - trace[0].t
    print(f"trace {args.trace}: {len(trace)} requests over {span:.0f} s, {out_tokens} output tokens "
          f"(offered {out_tokens / span:.1f} output tok/s)")  # fmt: skip
    context = sorted(a.prompt_tokens for a in trace)[len(trace) // 2]

    t0 = time.monotonic()
    cal = calibrate(args.model, args.kv_cache_memory, args.max_num_seqs, args.max_num_batched_tokens,
                    context, [1, 2, 4, 8, 16], [64, 128, 256, 512])  # fmt: skip
    print(f"calibration ({time.monotonic() - t0:.0f} s, load average {loadavg()}):")
    print("  decode step (batch: ms) " + ", ".join(f"{b}: {s * 1e3:.1f}" for b, s in cal.decode_points))
    print("  prefill step (tokens: ms) " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in cal.prefill_points))
    print(f"  fit: step overhead {cal.overhead_s * 1e3:.1f} ms, per decoding sequence "
          f"{cal.decode_token_s * 1e3:.2f} ms, per prompt token {cal.prefill_token_s * 1e3:.3f} ms "
          f"(prefill intercept {cal.prefill_overhead_s * 1e3:.1f} ms)")  # fmt: skip

    model = ReplicaModel(args.max_num_seqs, args.max_num_batched_tokens, cal.overhead_s, cal.prefill_token_s,
                         cal.decode_token_s)  # fmt: skip
    single = ReplicaModel(args.max_num_seqs, args.max_num_batched_tokens, cal.overhead_s, cal.prefill_token_s)
    sim = simulate(trace, model, ScalingPolicy(1, 1))
    sim_single = simulate(trace, single, ScalingPolicy(1, 1))

    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.jsonl")
        with open(trace_path, "w") as f:
            for a in trace:
                f.write(
                    json.dumps({"t": a.t, "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens})
                )
                f.write("\n")
        proc, startup_s = start_server(args, args.port, os.path.join(tmp, "server.log"))
        try:
            print(f"kvserve serve ready in {startup_s:.1f} s; load average {loadavg()}")
            t1 = time.monotonic()
            meas = bench(args, args.port, trace_path, os.path.join(tmp, "bench.json"))
            print(f"kvserve bench serve: {time.monotonic() - t1:.0f} s, load average {loadavg()}")
        finally:
            proc.terminate()
            proc.wait(60)

    m_tps, m_ttft = meas["output_throughput"], meas["ttft_ms"]["p50"] / 1000
    s_ttft, s1_ttft = quantile(sim.ttft_s, 0.5), quantile(sim_single.ttft_s, 0.5)
    print(f"measured (1 replica): {meas['completed']} done, {meas['failed']} failed, "
          f"{meas['duration_s']:.1f} s, {m_tps:.1f} output tok/s, TTFT p50 {m_ttft:.2f} s, "
          f"p90 {meas['ttft_ms']['p90'] / 1000:.2f} s")  # fmt: skip
    print(f"simulated (1 replica): {sim.makespan_s:.1f} s, {sim.output_tokens_per_s:.1f} output tok/s "
          f"(ratio {sim.output_tokens_per_s / m_tps:.3f}), TTFT p50 {s_ttft:.2f} s "
          f"(ratio {s_ttft / m_ttft if m_ttft else float('nan'):.3f})")  # fmt: skip
    print(f"simulated, one per-token cost (prefill's): {sim_single.output_tokens_per_s:.1f} output tok/s "
          f"(ratio {sim_single.output_tokens_per_s / m_tps:.3f}), TTFT p50 {s1_ttft:.2f} s")  # fmt: skip
    within = abs(sim.output_tokens_per_s / m_tps - 1) <= 0.2
    print(f"throughput within 20%: {'yes' if within else 'NO'}")

    policy = ScalingPolicy(1, 8, target_saturation=0.8, interval_s=15, cold_start_s=startup_s,
                           scale_down_delay_s=60)  # fmt: skip
    fixed, auto = min_replicas_for_slo(trace, model, policy, args.slo_ttft, args.slo_target)
    print(f"TTFT <= {args.slo_ttft:g} s for {args.slo_target:.0%} (cold start {startup_s:.0f} s, "
          f"interval 15 s, target saturation 0.8): fewest fixed replicas {fixed}, fewest min "
          f"replicas with autoscaling {auto}")  # fmt: skip
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
