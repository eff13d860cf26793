"""Tensor and pipeline parallelism on this machine: TP=2 and PP=2 (two rank processes, one
torch thread each) against TP=1 (one process, the same two threads' worth of cores), same
run, same workload.

Workload: B requests (default 32) x P prompt tokens x O output tokens, greedy, ignore_eos,
default model, fp32. Reports output tokens/s for each, and for the decode steps at full batch
the time per step split into: rank 0's forward pass (of which collectives: all-reduces and the
logits gather, including waiting for the slower rank), and the control plane (encode the step,
IPC to the ranks, rank 0's answer with the logits back, decode) = engine-side time in the
executor minus rank 0's execute time. No speed-up is expected on 2 shared cores: the overhead
share is the figure that says whether TP would scale where each rank has its own device.
Collective time measured inside the step includes waiting for the slower rank (uneven heads,
shared cores); a separate probe times the all-reduce transport alone (200 calls after a
barrier) and multiplies by the all-reduces of one step (2 per layer + 1 for the embedding).
TP=1 runs twice: with the default threads and with one thread (what each TP rank gets).

PP=2: each engine step sends one micro-batch (half the requests: one batch stream per stage)
and collects the other, so a decode step yields batch / 2 tokens. Overhead there is the step
time beyond the slower stage's own compute (its execute time less time blocked in send /
recv): control plane, the activation hand-off, and one stage waiting for the other. The
probe times one [16, hidden] float32 send / recv between the stages.

    python benchmarks/bench_parallel.py [--batch 32] [--prompt-len 32] [--output-len 48] [--only tp|pp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from cpu_info import cpu_flags  # noqa: E402

from benchmarks.common import machine  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def run(tp: int, args, threads: int | None = None, pp: int = 1) -> dict:
    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(
        "smollm2-135m", tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_memory="512MiB",
        max_num_seqs=args.batch,
    )  # fmt: skip
    engine, core = llm.llm_engine, llm.llm_engine.core
    ex = core.executor
    prompts = [[(i * 31 + 7 * k) % 49152 for i in range(args.prompt_len)] for k in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    engine.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    t0 = time.perf_counter()
    tokens, decode_steps, decode_s = 0, 0, 0.0
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) == args.batch and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
        )
        if full and decode_steps == 0:
            ex.run_s, ex.num_steps = 0.0, 0
            ex.collective_rpc("reset_stats")
        s0 = time.perf_counter()
        outs = engine.step()
        if full:
            decode_steps += 1
            decode_s += time.perf_counter() - s0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    total_s = time.perf_counter() - t0
    all_stats = ex.collective_rpc("stats")
    stats = all_stats[0]  # rank 0 (stage 0 under PP)
    probe = ex.collective_rpc("probe_all_reduce")[0]
    pp_probe = ex.collective_rpc("probe_pipeline_send")[-1]
    n = max(ex.num_steps, 1)
    res = {
        "tp": tp, "pp": pp, "tok_s": tokens / total_s, "step_ms": 1000 * decode_s / max(decode_steps, 1),
        "rank0_ms": 1000 * stats["execute_s"] / n, "collective_ms": 1000 * stats["collective_s"] / n,
        "control_ms": 1000 * (ex.run_s - stats["execute_s"]) / n if tp > 1 else 0.0, "steps": decode_steps,
        "threads": torch.get_num_threads() if tp * pp == 1 else 1,
        "pure_collective_ms": 1000 * probe * (2 * core.arch.num_layers + 1),
    }  # fmt: skip
    if pp > 1:
        # Per engine step (one micro-batch of batch / pp requests collected, one sent): each
        # stage's compute is its execute time less its time blocked in send / recv; whatever
        # the step takes beyond the slower stage's compute is overhead (control plane, the
        # activation hand-off, waiting for the other stage).
        compute = [1000 * (s["execute_s"] - s["pipeline_comm_s"]) / max(s["steps"], 1) for s in all_stats]
        res.update(
            stage_compute_ms=compute, stage_wait_ms=[1000 * s["pipeline_comm_s"] / max(s["steps"], 1)
                                                     for s in all_stats],
            control_ms=0.0, collective_ms=0.0, pure_collective_ms=1000 * pp_probe,
            overhead_ms=res["step_ms"] - max(compute),
        )  # fmt: skip
    core.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--only", choices=["tp", "pp"], help="skip the other parallel run")
    args = ap.parse_args()
    print(f"# {datetime.date.today()} | {machine()} | CPU flags: {cpu_flags()} | cores: {os.cpu_count()}")
    print(f"# batch {args.batch}, prompt {args.prompt_len}, output {args.output_len}, smollm2-135m fp32")
    threads = torch.get_num_threads()
    results = [run(1, args), run(1, args, threads=1)]
    if args.only != "pp":
        results.append(run(2, args))
    if args.only != "tp":
        results.append(run(1, args, pp=2))
    torch.set_num_threads(threads)
    base = results[0]
    print(
        "| layout | torch threads per rank | output tok/s | vs TP=1 | decode step ms | rank 0 forward ms | "
        "collectives ms (incl. waiting) | transport ms (probe) | control plane ms | overhead share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        layout = f"PP={r['pp']}" if r["pp"] > 1 else f"TP={r['tp']}"
        if r["pp"] > 1:
            share = f"{100 * r['overhead_ms'] / r['step_ms']:.1f}% (step beyond the slower stage's compute)"
        else:
            s1 = (r["collective_ms"] + r["control_ms"]) / r["step_ms"] if r["step_ms"] else 0.0
            s2 = (r["pure_collective_ms"] + r["control_ms"]) / r["step_ms"] if r["step_ms"] else 0.0
            share = f"{100 * s1:.1f}% ({100 * s2:.1f}% with probe transport)"
        print(
            f"| {layout} | {r['threads']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
            f"{r['step_ms']:.1f} | {r['rank0_ms']:.1f} | {r['collective_ms']:.1f} | "
            f"{r['pure_collective_ms']:.2f} | {r['control_ms']:.2f} | {share} |"
        )
        if r["pp"] > 1:
            print(
                f"#   PP stages: compute ms per step {[round(x, 1) for x in r['stage_compute_ms']]}, "
                f"blocked in send/recv ms {[round(x, 1) for x in r['stage_wait_ms']]}, "
                f"overhead {r['overhead_ms']:.1f} ms; hand-off probe {r['pure_collective_ms']:.2f} ms"
            )


if __name__ == "__main__":
    main()
