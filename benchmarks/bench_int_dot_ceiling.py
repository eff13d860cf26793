"""How close the AVX2 int4 matmul runs to what its instructions allow, against fp32 (issue 16).

Issue 16 asks a 32-stream server for 2x the fp32 configuration's throughput. On an AVX2-only
CPU that rests on one kernel: kvserve's int4 x int8 tile (csrc/quant_matmul_cpu.cpp, `half_i4`),
against oneDNN/MKL's fp32 GEMM. This script measures, in one run and on one thread:
1. the fp32 FMA peak: independent `vfmadd` chains in registers (2 x 8 MACs a cycle on most
   cores), the ceiling of any fp32 GEMM; and `vpmaddubsw` alone the same way (32 int8 products
   an instruction), the ceiling of any AVX2 int8 dot product;
2. the int4 tile's instruction stream on data in L1: one group of `half_i4<3>` (3 rows x 8
   outputs x 32 inputs: the nibble unpack, 24 `vpmaddubsw` on broadcast activations, the int16
   adds, the `vpmaddwd` widening, the per-group float steps) looped over a tiny buffer, and the
   same without the float steps: the ceiling of this kernel design on this core;
3. the real kernels on the model's four projection shapes at `--rows` rows: `int4_mm` and
   `torch.mm` in fp32;
and prints each as a fraction of its ceiling, and the kernels' ratio (what the server's 2x
needs, plus the step's other work). The register loops are a small C++ program built with
`c++ -O2 -mavx2 -mfma` (AVX2 machines only). Prints the CPU flags and the load average.

    python benchmarks/bench_int_dot_ceiling.py [--rows 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}

# Loops over registers (the tile's also over a 96-byte buffer). OPAQUE keeps the compiler from
# hoisting work out of a loop; iterations depend on each other only through the accumulators, as
# in the kernel.
LOOPS = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// GFLOP/s: 10 independent FMA chains (latency 4-5, 2 a cycle).
__attribute__((noinline)) double fma_peak(long n) {
  __m256 a[10];
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(1.0f + i);
  __m256 b = _mm256_set1_ps(0.999f);
  const double t = now();
  for (long it = 0; it < n; ++it) {
    OPAQUE(b);
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) a[i] = _mm256_fmadd_ps(a[i], b, b);
  }
  const double s = now() - t;
  for (int i = 0; i < 10; ++i) OPAQUE(a[i]);
  return n * 10.0 * 16 / s / 1e9;
}

// GMAC/s of vpmaddubsw alone (32 u8 x s8 products each): 6 independent chains (latency 3).
__attribute__((noinline)) double maddubs_peak(long n) {
  __m256i a[6], w[6];
  for (int i = 0; i < 6; ++i) a[i] = _mm256_setzero_si256(), w[i] = _mm256_set1_epi8(i + 1);
  const double t = now();
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) a[i] = _mm256_maddubs_epi16(w[i], a[i]);
  }
  const double s = now() - t;
  for (int i = 0; i < 6; ++i) OPAQUE(a[i]);
  return n * 6.0 * 32 / s / 1e9;
}

// GMAC/s: the AVX2 int4 tile's instruction stream (half_i4<3>: 3 rows x 8 outputs x 32 inputs
// = 768 MACs a group) over data in L1: activations broadcast from a 96-byte buffer as the kernel
// does, the weights one opaque register per chunk instead of a load from memory. The group's
// bf16 scales arrive as float registers (the kernel converts them: 5 instructions a group), so
// the ceiling is a little generous.
alignas(64) static int8_t xbuf[3 * 32];
alignas(64) static float dbuf[8];
template <bool FLOAT_STEPS>
__attribute__((noinline)) double int4_mix(long n) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i v = _mm256_set1_epi8(0x5A);
  __m256 acc[3], bias[3];
  __m256i iacc[3];
  for (int c = 0; c < 3; ++c) acc[c] = bias[c] = _mm256_setzero_ps(), iacc[c] = _mm256_setzero_si256();
  __m256 sw = _mm256_set1_ps(0.5f), mw = _mm256_set1_ps(0.25f);
  const double t = now();
  for (long it = 0; it < n; ++it) {
    const int8_t* xp = xbuf;
    const float* dp = dbuf;
    __asm__ volatile("" : "+r"(xp), "+r"(dp));  // loaded anew each group, as in the kernel
    __m256i s16[3];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      OPAQUE(v);  // a new weight chunk
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#pragma GCC unroll 3
      for (int c = 0; c < 3; ++c) {
        int32_t a, b;
        std::memcpy(&a, xp + c * 32 + 8 * j, 4);
        std::memcpy(&b, xp + c * 32 + 8 * j + 4, 4);
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
        s16[c] = j == 0 ? p : _mm256_add_epi16(s16[c], p);
      }
    }
    OPAQUE(sw);
    OPAQUE(mw);
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) {
      const __m256i isum = _mm256_madd_epi16(s16[c], ones);
      if (FLOAT_STEPS) {
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sw, _mm256_set1_ps(dp[c])), acc[c]);
        bias[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dp[4 + c]), bias[c]);
      } else {
        iacc[c] = _mm256_add_epi32(iacc[c], isum);
      }
    }
  }
  const double s = now() - t;
  for (int c = 0; c < 3; ++c) {
    OPAQUE(acc[c]);
    OPAQUE(bias[c]);
    OPAQUE(iacc[c]);
  }
  return n * 768.0 / s / 1e9;
}

int main(int argc, char** argv) {
  const long n = argc > 1 ? atol(argv[1]) : 20000000;
  double f = 0, u = 0, m = 0, i = 0;
  for (int r = 0; r < 5; ++r) {  // best of 5: a loop the scheduler interrupted reads low
    f = std::max(f, fma_peak(n));
    u = std::max(u, maddubs_peak(n));
    m = std::max(m, int4_mix<true>(n / 8));
    i = std::max(i, int4_mix<false>(n / 8));
  }
  printf("%f %f %f %f\n", f, u, m, i);
}
"""


def register_loops(iterations: int) -> tuple[float, float, float, float]:
    """(fp32 FMA peak GFLOP/s, vpmaddubsw alone GMAC/s, int4 tile-mix GMAC/s, the same without
    float steps), one thread."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "loops.cpp"), os.path.join(tmp, "loops")
        with open(src, "w") as f:
            f.write("#include <algorithm>\n" + LOOPS)
        subprocess.run(["c++", "-O2", "-mavx2", "-mfma", "-std=c++17", src, "-o", exe], check=True)
        out = subprocess.run([exe, str(iterations)], check=True, capture_output=True, text=True).stdout
    f, u, m, i = (float(v) for v in out.split())
    return f, u, m, i


def best_seconds(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernels(rows: int, reps: int) -> tuple[float, float]:
    """GMAC/s of int4_mm and of fp32 torch.mm over the four shapes (sum of their best times)."""
    import torch

    from kvserve.model.layers import quant_kernels as qk

    mod = qk.kernels_for(qk.selected_variant())
    t_int4 = t_fp32 = 0.0
    macs = 0
    for n, k in SHAPES.values():
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        packed, sz = qk.pack_int4(codes, torch.rand(n, k // 32) * 0.01, torch.rand(n, k // 32) * 0.01)
        x, w = torch.randn(rows, k), torch.randn(n, k)
        t_int4 += best_seconds(lambda: mod.int4_mm(x, packed, sz, n), reps)  # noqa: B023
        t_fp32 += best_seconds(lambda: torch.mm(x, w.t()), reps)  # noqa: B023
        macs += rows * n * k
    return macs / t_int4 / 1e9, macs / t_fp32 / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="activation rows (a batched step's)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of loops and kernels")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--iterations", type=int, default=20_000_000)
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# CPU flags: {flags}; load average {os.getloadavg()[0]:.2f}")
    if "avx2" not in flags.split():
        print("this machine has no AVX2: nothing to measure")
        return 0
    import torch

    from kvserve.model.layers import quant_kernels as qk

    torch.set_num_threads(1)
    print(f"# one thread; int4_mm variant {qk.selected_variant()}, {args.rows} rows, shapes {list(SHAPES)}")
    heads = ["round", "fp32 FMA peak GMAC/s", "vpmaddubsw alone GMAC/s (x FMA)",
             "torch.mm fp32 GMAC/s (of peak)", "int4 mix ceiling GMAC/s (x FMA peak)", "without float steps",
             "int4_mm GMAC/s (of ceiling)", "int4_mm / torch.mm"]  # fmt: skip
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in range(args.rounds):
        flops, maddubs, mix, mix_int = register_loops(args.iterations)
        fma_mac = flops / 2
        int4, fp32 = kernels(args.rows, args.reps)
        cells = [f"{fma_mac:.1f}", f"{maddubs:.1f} ({maddubs / fma_mac:.2f}x)",
                 f"{fp32:.1f} ({fp32 / fma_mac:.0%})", f"{mix:.1f} ({mix / fma_mac:.2f}x)", f"{mix_int:.1f}",
                 f"{int4:.1f} ({int4 / mix:.0%})", f"{int4 / fp32:.2f}x"]  # fmt: skip
        print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
