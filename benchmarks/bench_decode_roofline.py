"""Decode against this machine's limits, in one run (issue 16's acceptance figures).

Measures, in the same process: memory read bandwidth (sum of a large array), fp32 GEMM peak
(a large torch.mm) and int8 GEMM peak (the faster of the dynamic quantized linear and
kvserve's native int8 kernel; under an ISA cap, kvserve's alone), all with the engine's
threads. Then, for the default model in each weight format (offline engine):
- single-stream decode ms/token (one ~128-token prompt; time of an (n+1)-token run minus a
  1-token run, divided by n) against the weight-bandwidth floor: bytes read per token (every
  weight once: the tied table is read whole by the lm_head, its lookup row is noise) divided
  by the measured bandwidth (the best read of the run; each round also reads it just before
  and just after its single-stream run and reports the ratio against their mean, as a shared
  host drifts). Target: <= 1.5x the floor for int4 and int8;
- a 64-sequence decode step (whole step: 64 ~16-token prompts, decode time as above over the
  same batch) as achieved GFLOP/s against the GEMM peak of its compute format. The FLOPs are
  2 x the model's weights per token (from the fp32 engine's weight bytes / 4), attention left
  out (about 1% at these contexts), so the fraction is slightly understated. Target: >= 60%
  of the peak of its compute format: fp32 for fp32, int8 for int4 and int8 (the native
  kernels' integer dot products; fp32 where they are not built), bf16 for bf16 (`--formats
  ...,bf16`, where the CPU has native bf16).
Each figure is the best of --rounds (a shared machine: the least disturbed round). With
`--threads 1` every time is this process's CPU time (the engine runs in it), so other
processes' load shows less; with more threads, wall time.

    python benchmarks/bench_decode_roofline.py [--formats fp32,int4,int8,bf16,int4-kv8] [--rounds 3]

(`-kv8`: the same weights with an int8 KV cache, `make serve`'s configuration for int4.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import make_prompts, run_header  # noqa: E402
from benchmarks.cpu_info import isa_cap  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.layers.quant_kernels import load_quant_kernels  # noqa: E402
from kvserve.platform.cpu_isa import cpu_isa  # noqa: E402

FORMATS = {
    "fp32": {},
    "int4": {"quantization": "int4"},
    "int8": {"quantization": "int8"},
    "bf16": {"dtype": "bfloat16"},  # only where the CPU computes bf16 natively (AMX / avx512_bf16)
    # with an int8 KV cache (`make serve` runs int4-kv8): the same weights, a 4x smaller cache
    "int4-kv8": {"quantization": "int4", "kv_cache_dtype": "int8"},
    "int8-kv8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
TARGET_FLOOR, TARGET_PEAK = 1.5, 0.60
STEADY = 0.15  # a run's limit read before and after it may differ by this fraction
# The clock: with one torch thread, this process's CPU time (the work, not the time the
# scheduler gave other processes on a shared machine); with more, wall time.
clock = time.perf_counter


def best_s(fn, reps: int, warm_s: float = 0.0) -> float:
    """Best time of `reps` calls, after one call or, with warm_s, after calling fn for that
    long."""
    fn()
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def read_bandwidth(mib: int = 512, reps: int = 8) -> float:
    """Bytes/s of reading an array far larger than any cache (torch.sum, the engine's threads)."""
    a = torch.ones(mib * 2**20 // 4)
    return a.numel() * 4 / best_s(lambda: a.sum(), reps)


def copy_bandwidth(mib: int = 512, reps: int = 8) -> float:
    """Bytes/s moved (read + write) by a large copy, for comparison."""
    a, b = torch.ones(mib * 2**20 // 4), torch.empty(mib * 2**20 // 4)
    return 2 * a.numel() * 4 / best_s(lambda: b.copy_(a), reps)


def gemm_peak_fp32(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n x n x n fp32 torch.mm (oneDNN)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_s(lambda: torch.mm(a, b), reps)


def gemm_peak_bf16(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n x n x n bf16 torch.mm (oneDNN: AMX or avx512_bf16 where present)."""
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    return 2 * n**3 / best_s(lambda: torch.mm(a, b), reps)


def gemm_peak_int8(n: int = 1024, reps: int = 5) -> float | None:
    """OP/s of the fastest int8 GEMM here, n x n x n: PyTorch's dynamic quantized linear
    (fbgemm / oneDNN u8 x s8, activations quantized per call) or kvserve's native int8 kernel
    (activations quantized per group of 32), whichever is faster; None without either.
    (torch._int_mm measured ~0.3 GOP/s on this CPU: a reference loop, not a peak.)
    Each is timed after a second of calls: on the AMX machine the first second read ~25%
    below the steady rate (730-750 against 915-1080 GOP/s in the same process), which made
    earlier rounds' peak figures low and their "/ peak" fractions high.
    Under an ISA cap (ONEDNN_MAX_CPU_ISA, as benchmarks/avx2_emulated.sh --native sets) the
    dynamic linear is left out: fbgemm picks its kernels from CPUID, not from the caps (on the
    AMX host its JIT code under the caps was AVX-512 VNNI, and read 522 GOP/s: no AVX2 peak;
    docs/BENCHMARKS.md issue 16 round 37)."""
    from kvserve.model.layers.quant_batched import dynamic_int8_mm, dynamic_int8_pack
    from kvserve.model.layers.quant_kernels import pack_int8
    from kvserve.model.layers.quantization import quantize_weight

    q = quantize_weight(torch.randn(n, n), "int8")
    x = torch.randn(n, n)
    rates = []
    packed = None if isa_cap() else dynamic_int8_pack(q.codes, q.scales)
    if packed is not None:
        rates.append(2 * n**3 / best_s(lambda: dynamic_int8_mm(x, packed), reps, warm_s=1.0))
    mod = load_quant_kernels()
    if mod is not None:
        codes, scales = pack_int8(q.codes, q.scales)
        rates.append(2 * n**3 / best_s(lambda: mod.int8_mm(x, codes, scales, n), reps, warm_s=1.0))
    return max(rates) if rates else None


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = clock()
    llm.generate(prompts, params, use_tqdm=False)
    return clock() - t0


def decode_s(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Seconds per decode step: (n+1)-token run minus 1-token run, over n."""
    return (_run(llm, prompts, n + 1) - _run(llm, prompts, 1)) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp32,int4,int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    global clock
    if args.threads:  # on a shared machine 1 avoids OpenMP barriers waiting on a preempted thread
        torch.set_num_threads(args.threads)
    if torch.get_num_threads() == 1:
        clock = time.process_time
    print(f"clock: {'process CPU time' if clock is time.process_time else 'wall time'}")
    print(run_header(), flush=True)

    bw, cbw = read_bandwidth(), copy_bandwidth()
    peak32, peak8 = gemm_peak_fp32(), gemm_peak_int8()
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s (copy {cbw / 1e9:.1f} GB/s read+write)")
    source = (
        "kvserve's own kernel: under an ISA cap fbgemm's would run this host's wider instructions"
        if isa_cap()
        else "the faster of quantized::linear_dynamic and kvserve's"
    )
    int8 = f"{peak8 / 1e9:.1f} GOP/s ({source})" if peak8 else "n/a"
    print(f"GEMM peak fp32 {peak32 / 1e9:.1f} GFLOP/s, int8 {int8}", flush=True)

    names = args.formats.split(",")
    if "bf16" in names and not cpu_isa().native_bf16:
        print("bf16 left out: this CPU has no native bf16, where a bfloat16 engine computes in fp32")
        names.remove("bf16")
    # Each format's compute format: the native kernels' dot products are int8 x int8.
    kind = {n: "fp32" for n in names}
    for name in names:
        if name.startswith(("int4", "int8")) and peak8 and load_quant_kernels() is not None:
            kind[name] = "int8"
    if "bf16" in names:
        kind["bf16"] = "bf16"
    peak_fns = {"fp32": gemm_peak_fp32, "int8": gemm_peak_int8, "bf16": gemm_peak_bf16}
    peaks = {"fp32": peak32, "int8": peak8}
    if "bf16" in names:
        peaks["bf16"] = gemm_peak_bf16()
        print(f"GEMM peak bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s (bf16's compute format)", flush=True)
    llms = {n: LLM("smollm2-135m", kv_cache_memory="256MiB", **FORMATS[n]) for n in names}
    model = {n: llm.llm_engine.model_runner.model for n, llm in llms.items()}
    ref = llms.get("fp32") or LLM("smollm2-135m", kv_cache_memory="64MiB")
    params = ref.llm_engine.model_runner.model.weight_bytes() / 4  # fp32: 4 bytes a weight
    tok = next(iter(llms.values())).tokenizer
    one = make_prompts(tok, 1, 128, seed=1)
    batch = make_prompts(tok, args.batch, 16, seed=2, jitter=2)
    for llm in llms.values():
        _run(llm, one, 4)  # warm-up
    single = {n: float("inf") for n in names}
    step = {n: float("inf") for n in names}
    # A shared host's speed drifts by tens of percent within minutes, so each round also reads
    # the bandwidth around its single-stream run and the GEMM peak around its batched step
    # (just before and just after), and takes each ratio against the mean of the two readings
    # (the best of the run may come from a fast minute the step never saw, and a slow minute's
    # peak flatters it). A run whose two readings differ by more than STEADY (the host changed
    # speed while it ran, so neither describes it) stays in every figure, and is also left out
    # of a second, "steady" median.
    ratios: dict[str, list[float]] = {n: [] for n in names}
    fractions: dict[str, list[float]] = {n: [] for n in names}
    steady_ratios: dict[str, list[float]] = {n: [] for n in names}
    steady_fractions: dict[str, list[float]] = {n: [] for n in names}
    flops = 2 * params * args.batch  # a batched step's

    def bracketed(limit, llm: LLM, prompts: list[list[int]]) -> tuple[float, float, bool]:
        """decode_s of `prompts`, the mean of limit(reps=3) read before and after it, and whether
        the two readings agree within STEADY."""
        before = limit(reps=3)
        seconds = decode_s(llm, prompts, args.tokens)
        after = limit(reps=3)
        return seconds, (before + after) / 2, abs(after - before) <= STEADY * max(before, after)

    for rnd in range(args.rounds):
        for name, llm in llms.items():
            s1, bw_now, bw_steady = bracketed(read_bandwidth, llm, one)
            bw = max(bw, bw_now)
            sb, peak_now, peak_steady = bracketed(peak_fns[kind[name]], llm, batch)
            peaks[kind[name]] = max(peaks[kind[name]], peak_now)
            single[name], step[name] = min(single[name], s1), min(step[name], sb)
            ratios[name].append(s1 * bw_now / model[name].weight_bytes())
            fractions[name].append(flops / sb / peak_now)
            if bw_steady:
                steady_ratios[name].append(ratios[name][-1])
            if peak_steady:
                steady_fractions[name].append(fractions[name][-1])
            print(f"round {rnd + 1} {name}: single {s1 * 1e3:.2f} ms/token ({ratios[name][-1]:.2f}x the "
                  f"floor at {bw_now / 1e9:.1f} GB/s read around it{'' if bw_steady else ', unsteady'}), "
                  f"{args.batch}-seq step {sb * 1e3:.1f} ms ({fractions[name][-1]:.0%} of the {kind[name]} "
                  f"peak of {peak_now / 1e9:.1f} G/s measured around it"
                  f"{'' if peak_steady else ', unsteady'}); load {os.getloadavg()[0]:.2f}",
                  flush=True)  # fmt: skip

    print(f"\nmodel weights per token {params / 1e6:.1f} M (x2 FLOPs); load average {os.getloadavg()}")
    print(f"| weights | bytes read / token | floor ms (at {bw / 1e9:.1f} GB/s) | single-stream ms/token | "
          f"/ floor (target <= {TARGET_FLOOR}) | per round: / floor at that round's bandwidth, "
          f"median (range) | {args.batch}-seq step ms | GFLOP/s | / its format's best peak "
          f"(target >= {TARGET_PEAK:.0%}) | per round: / the peak read around it, "
          "median (range) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        wb = model[name].weight_bytes()
        floor = wb / bw
        gflops = flops / step[name] / 1e9
        r, f = sorted(ratios[name]), sorted(fractions[name])
        print(f"| {name} | {wb / 2**20:.1f} MiB | {floor * 1e3:.2f} | {single[name] * 1e3:.2f} | "
              f"{single[name] / floor:.2f}x | {statistics.median(r):.2f}x ({r[0]:.2f}-{r[-1]:.2f}) | "
              f"{step[name] * 1e3:.1f} | {gflops:.1f} | {gflops * 1e9 / peaks[kind[name]]:.0%} | "
              f"{statistics.median(f):.0%} ({f[0]:.0%}-{f[-1]:.0%}) |")  # fmt: skip
    print(f"\nsteady runs only (the limit read before and after within {STEADY:.0%}):")
    for name in names:
        r, f = sorted(steady_ratios[name]), sorted(steady_fractions[name])
        single_part = f"{statistics.median(r):.2f}x ({r[0]:.2f}-{r[-1]:.2f})" if r else "none"
        step_part = f"{statistics.median(f):.0%} ({f[0]:.0%}-{f[-1]:.0%})" if f else "none"
        print(f"{name}: single stream / floor {single_part}, {len(r)} of {len(ratios[name])} runs; "
              f"{args.batch}-seq step / peak {step_part}, {len(f)} of {len(fractions[name])} "
              "runs")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
