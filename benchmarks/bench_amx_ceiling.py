"""What the AMX int8 and int4 panels can reach with per-group scales, against the kernels (issue 16).

Issue 16 asks a 64-sequence decode step for 60% of the int8 GEMM peak. On an AMX machine that
peak is kvserve's own int8 kernel (csrc/quant_matmul_cpu.cpp, `amx_panel_q8`), and the int4
weights run through `amx_panel_i4`. Both quantize activations per group of 32 inputs, as the
weights are scaled, so each tile multiply covers one group (16 rows x 16 outputs x 32 inputs,
half the 64 inputs a tile row can hold) and its sums must be stored and scaled before the next
group's are added. This script measures on one thread, on data in L1/L2, 64 activation rows
over the default model's four projection shapes:
1. the tile multiplies alone, 32 and 64 inputs a multiply (tiles loaded once): the tile unit's
   ceiling at the kernels' shape and at the full width;
2. the kernels' tile sequence per group (zero, load the activations' and the weights' tiles,
   multiply, store the sums; four groups in flight), without any float step;
3. that plus int8's float steps per row and group (convert, fma with the activation scale);
4. that plus int4's (scale product, convert, fma, and the zero term's fma), each panel's 4-bit
   codes unpacked to B tiles in L1 first, as the kernel does (its half-size weights read, its
   scales already float: a little generous);
5. the real kernels, `int8_mm` and `int4_mm`, at the same rows and shapes;
and prints the ratios: what the tile sequence leaves of the tile unit, what the float steps leave
of that, and int4's ceiling against int8's (the bound on an int4 step's fraction of the int8
peak). Then the same ceilings with coarser activation scales, arithmetic the kernels do not
use (benchmarks/bench_activation_groups.py measures what each costs in perplexity):
6. int4 with activations scaled per row: the weights' groups still need their own float
   steps, but without the scale product (convert, fma with the weight scale, the zero term's
   fma; the row's scale once at the end);
7. int8 with activations scaled per 64 and per 192 inputs: full-width multiplies (64 inputs),
   one and three of them summed in a tile before its sums are stored and scaled;
8. the kernels' arithmetic with the tile sequence blocked 2 x 2 (two row tiles x two panels
   per group, so each tile load feeds two multiplies), int8's and int4's float steps.
The loops are a small C++ program built with `c++ -O2 -march=sapphirerapids`; on a CPU without
AMX-INT8 there is nothing to measure. Prints the CPU flags and the load average.

    python benchmarks/bench_amx_ceiling.py [--rows 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_int_dot_ceiling import SHAPES, best_seconds  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402

LOOPS = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The kernels' tile configuration: C 0-3 (16 x 16 int32), A 4-5 (16 rows x 32 bytes: one
// group), B 6-7 (8 rows x 64 bytes, VNNI layout); `wide` gives A 64 bytes and B 16 rows.
static void configure(bool wide) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  auto tile = [&](int t, int rows, int colsb) { cfg[16 + 2 * t] = colsb, cfg[48 + t] = rows; };
  for (int t = 0; t < 4; ++t) tile(t, 16, 64);
  for (int t = 4; t < 6; ++t) tile(t, 16, wide ? 64 : 32);
  for (int t = 6; t < 8; ++t) tile(t, wide ? 16 : 8, 64);
  __asm__ volatile("" : : "r"(cfg) : "memory");  // GCC 12 dropped the stores above as dead otherwise
  _tile_loadconfig(cfg);
}

// The multiplies-alone loops' operands, loaded once.
static void load_operands(const int8_t* x, int stride, const uint8_t* b) {
  _tile_loadd(4, x, stride);
  _tile_loadd(5, x, stride);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
}

struct Shape { int n, k; };

// The sums of the first nb (1-4) groups in flight, C tiles 0-3, to c[nb][16 x 16].
static inline void store_sums(int nb, int32_t* c) {
  _tile_stored(0, c, 64);
  if (nb > 1) _tile_stored(1, c + 256, 64);
  if (nb > 2) _tile_stored(2, c + 512, 64);
  if (nb > 3) _tile_stored(3, c + 768, 64);
}

// Every group of every 16-row tile of every 16-output panel of each shape: `mode` 0 multiplies
// only, 1 the tile sequence, 2 with int8's float steps, 3 with int4's and its unpacking (b's
// bytes read as a panel's packed 4-bit codes, half an int8 panel's). Returns seconds.
template <int MODE>
double pass(const std::vector<Shape>& shapes, int M, const int8_t* x, const uint8_t* b, const float* dx,
            const float* sx, const float* scales, float* y) {
  alignas(64) int32_t c[4 * 256];
  alignas(64) static uint8_t unpacked[64 * 512];  // a panel's B tiles, up to 64 groups
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const double t0 = now();
  for (const Shape& s : shapes) {
    const int ng = s.k / 32;
    for (int p = 0; p < s.n / 16; ++p) {
      const uint8_t* bp = b + (size_t)p * ng * 512;
      if (MODE >= 3) {  // low nibbles of each 64-byte chunk, then its high ones (the kernel's layout)
        const uint8_t* w = b + (size_t)p * ng * 256;
        for (int i = 0; i < ng * 4; ++i) {
          const __m512i v = _mm512_loadu_si512(w + i * 64);
          _mm512_store_si512(unpacked + 128 * i, _mm512_and_si512(v, nibble));
          _mm512_store_si512(unpacked + 128 * i + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        }
        bp = unpacked;
      }
      for (int m0 = 0; m0 + 16 <= M; m0 += 16) {
        __m512 acc[16], bias[16];
        for (int r = 0; r < 16; ++r) acc[r] = bias[r] = _mm512_setzero_ps();
        for (int g0 = 0; g0 < ng; g0 += 4) {
          const int nb = std::min(4, ng - g0);
          const int8_t* xa = x + m0 * s.k + g0 * 32;
          const uint8_t* bb = bp + g0 * 512;
          if (MODE == 0) {
            _tile_dpbssd(0, 4, 6);
            if (nb > 1) _tile_dpbssd(1, 5, 7);
            if (nb > 2) _tile_dpbssd(2, 4, 6);
            if (nb > 3) _tile_dpbssd(3, 5, 7);
            continue;
          }
#define SLOT(C, A, B) _tile_zero(C); _tile_loadd(A, xa + C * 32, s.k); _tile_loadd(B, bb + C * 512, 64); \
  _tile_dpbssd(C, A, B);
          SLOT(0, 4, 6)
          if (nb > 1) { SLOT(1, 5, 7) }
          if (nb > 2) { SLOT(2, 4, 6) }
          if (nb > 3) { SLOT(3, 5, 7) }
#undef SLOT
          store_sums(nb, c);
          if (MODE == 1) continue;
          for (int k = 0; k < nb; ++k) {
            const int g = g0 + k;
            const __m512 sw = _mm512_load_ps(scales + g * 32), mw = _mm512_load_ps(scales + g * 32 + 16);
            for (int r = 0; r < 16; ++r) {
              const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * k + 16 * r));
              const int i = (m0 + r) * ng + g;
              if (MODE == 2) {
                acc[r] = _mm512_fmadd_ps(isum, _mm512_set1_ps(dx[i]), acc[r]);
              } else if (MODE == 4) {  // activations scaled per row: dx once at the end
                acc[r] = _mm512_fmadd_ps(isum, sw, acc[r]);
                bias[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[i]), bias[r]);
              } else {
                acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(sw, _mm512_set1_ps(dx[i])), acc[r]);
                bias[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[i]), bias[r]);
              }
            }
          }
        }
        for (int r = 0; r < 16; ++r) {
          const __m512 out = _mm512_add_ps(acc[r], bias[r]);
          const __m512 row_scale = _mm512_set1_ps(MODE == 4 ? dx[m0 + r] : 1.0f);
          _mm512_storeu_ps(y + (m0 + r) * 16, _mm512_mul_ps(out, row_scale));
        }
      }
    }
  }
  return now() - t0;
}

// The tile sequence blocked 2 x 2 (two 16-row tiles x two panels a group: each A and B tile
// loaded once for two multiplies, against once for one above), one group in flight, with
// int8's float steps (INT4: int4's, its panels' codes unpacked first); the 64 accumulators
// (32 rows x 2 panels) on the stack.
template <bool INT4>
double pass_2x2(const std::vector<Shape>& shapes, int M, const int8_t* x, const uint8_t* b,
                const float* dx, const float* sx, const float* scales, float* y) {
  alignas(64) int32_t c[4 * 256];
  alignas(64) static uint8_t unpacked[2][64 * 512];
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const double t0 = now();
  for (const Shape& s : shapes) {
    const int ng = s.k / 32;
    for (int p = 0; p + 1 < s.n / 16; p += 2) {
      const uint8_t* bp[2] = {b + (size_t)p * ng * 512, b + (size_t)(p + 1) * ng * 512};
      if (INT4)
        for (int h = 0; h < 2; ++h) {
          const uint8_t* w = b + (size_t)(p + h) * ng * 256;
          for (int i = 0; i < ng * 4; ++i) {
            const __m512i v = _mm512_loadu_si512(w + i * 64);
            _mm512_store_si512(unpacked[h] + 128 * i, _mm512_and_si512(v, nibble));
            _mm512_store_si512(unpacked[h] + 128 * i + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
          }
          bp[h] = unpacked[h];
        }
      for (int m0 = 0; m0 + 32 <= M; m0 += 32) {
        __m512 acc[4][16], bias[4][16];
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 16; ++r) acc[t][r] = bias[t][r] = _mm512_setzero_ps();
        for (int g = 0; g < ng; ++g) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          _tile_loadd(4, x + m0 * s.k + g * 32, s.k);
          _tile_loadd(6, bp[0] + g * 512, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_loadd(7, bp[1] + g * 512, 64);
          _tile_dpbssd(1, 4, 7);
          _tile_loadd(5, x + (m0 + 16) * s.k + g * 32, s.k);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
          store_sums(4, c);
          const __m512 sw = _mm512_load_ps(scales + g * 32), mw = _mm512_load_ps(scales + g * 32 + 16);
          for (int t = 0; t < 4; ++t)
            for (int r = 0; r < 16; ++r) {
              const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * t + 16 * r));
              const int i = (m0 + 16 * (t >> 1) + r) * ng + g;
              if (!INT4) {
                acc[t][r] = _mm512_fmadd_ps(isum, _mm512_set1_ps(dx[i]), acc[t][r]);
              } else {
                acc[t][r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(sw, _mm512_set1_ps(dx[i])), acc[t][r]);
                bias[t][r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[i]), bias[t][r]);
              }
            }
        }
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 16; ++r)  // (both panels' into the same sink)
            _mm512_storeu_ps(y + (m0 + 16 * (t >> 1) + r) * 16, _mm512_add_ps(acc[t][r], bias[t][r]));
      }
    }
  }
  return now() - t0;
}

// int8 with activations scaled per group of 64 x W inputs: each group's W full-width
// multiplies (16 rows x 16 outputs x 64 inputs) accumulate in one tile before its sums are
// stored and scaled (convert, fma with the activation scale). Needs configure(true).
template <int W>
double pass_coarse(const std::vector<Shape>& shapes, int M, const int8_t* x, const uint8_t* b,
                   const float* dx, float* y) {
  alignas(64) int32_t c[4 * 256];
  const double t0 = now();
  for (const Shape& s : shapes) {
    const int ng = s.k / (64 * W), ng32 = s.k / 32;
    for (int p = 0; p < s.n / 16; ++p) {
      const uint8_t* bp = b + (size_t)p * ng32 * 512;
      for (int m0 = 0; m0 + 16 <= M; m0 += 16) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int g0 = 0; g0 < ng; g0 += 4) {
          const int nb = std::min(4, ng - g0);
#define SLOT(C, A, B) _tile_zero(C); \
  for (int w = 0; w < W; ++w) { \
    const int at = ((g0 + C) * W + w) * 64; \
    _tile_loadd(A, x + m0 * s.k + at, s.k); _tile_loadd(B, bp + at * 16, 64); _tile_dpbssd(C, A, B); \
  }
          SLOT(0, 4, 6)
          if (nb > 1) { SLOT(1, 5, 7) }
          if (nb > 2) { SLOT(2, 4, 6) }
          if (nb > 3) { SLOT(3, 5, 7) }
#undef SLOT
          store_sums(nb, c);
          for (int k = 0; k < nb; ++k)
            for (int r = 0; r < 16; ++r) {
              const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * k + 16 * r));
              acc[r] = _mm512_fmadd_ps(isum, _mm512_set1_ps(dx[(m0 + r) * ng + g0 + k]), acc[r]);
            }
        }
        for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + (m0 + r) * 16, acc[r]);
      }
    }
  }
  return now() - t0;
}

// The tile multiplies alone at full width: 64 inputs a multiply, as many multiplies per output
// as groups of 64.
double pass_wide(const std::vector<Shape>& shapes, int M) {
  const double t0 = now();
  for (const Shape& s : shapes)
    for (int p = 0; p < s.n / 16; ++p)
      for (int m0 = 0; m0 + 16 <= M; m0 += 16)
        for (int g0 = 0; g0 < s.k / 64; g0 += 4) {
          const int nb = std::min(4, s.k / 64 - g0);
          _tile_dpbssd(0, 4, 6);
          if (nb > 1) _tile_dpbssd(1, 5, 7);
          if (nb > 2) _tile_dpbssd(2, 4, 6);
          if (nb > 3) _tile_dpbssd(3, 5, 7);
        }
  return now() - t0;
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    printf("refused\n");
    return 0;
  }
  const int M = atoi(argv[1]), reps = atoi(argv[2]);
  std::vector<Shape> shapes;
  int max_k = 0, max_n = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    shapes.push_back({atoi(argv[i]), atoi(argv[i + 1])});
    max_k = std::max(max_k, shapes.back().k), max_n = std::max(max_n, shapes.back().n);
  }
  const int ng = max_k / 32;
  std::vector<int8_t> x((size_t)M * max_k);
  std::vector<uint8_t> b((size_t)(max_n / 16) * ng * 512);
  std::vector<float> dx((size_t)M * ng), sx(dx.size()), y((size_t)M * 16);
  alignas(64) static float scales[64 * 32];
  for (size_t i = 0; i < x.size(); ++i) x[i] = (int8_t)(i * 7 % 23 - 11);
  for (size_t i = 0; i < b.size(); ++i) b[i] = (uint8_t)(i * 5 % 16);
  for (size_t i = 0; i < dx.size(); ++i) dx[i] = 0.01f * (1 + i % 7), sx[i] = 0.1f * (1 + i % 5);
  for (int i = 0; i < 64 * 32; ++i) scales[i] = 0.02f * (1 + i % 3);
  double ops = 0;
  for (const Shape& s : shapes) ops += 2.0 * M * s.n * s.k;
  double best[10] = {1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9};
  configure(false);
  load_operands(x.data(), max_k, b.data());
  for (int r = 0; r < reps; ++r) {  // best of reps, the modes interleaved
    auto run = [&](auto mode) {
      constexpr int m = decltype(mode)::value;
      return pass<m>(shapes, M, x.data(), b.data(), dx.data(), sx.data(), scales, y.data());
    };
    best[0] = std::min(best[0], run(std::integral_constant<int, 0>()));
    best[1] = std::min(best[1], run(std::integral_constant<int, 1>()));
    best[2] = std::min(best[2], run(std::integral_constant<int, 2>()));
    best[3] = std::min(best[3], run(std::integral_constant<int, 3>()));
    best[5] = std::min(best[5], run(std::integral_constant<int, 4>()));
    best[8] = std::min(best[8], pass_2x2<false>(shapes, M, x.data(), b.data(), dx.data(), sx.data(), scales,
                                                y.data()));
    best[9] = std::min(best[9], pass_2x2<true>(shapes, M, x.data(), b.data(), dx.data(), sx.data(), scales,
                                               y.data()));
    configure(true);
    load_operands(x.data(), max_k, b.data());
    best[4] = std::min(best[4], pass_wide(shapes, M));
    best[6] = std::min(best[6], pass_coarse<1>(shapes, M, x.data(), b.data(), dx.data(), y.data()));
    best[7] = std::min(best[7], pass_coarse<3>(shapes, M, x.data(), b.data(), dx.data(), y.data()));
    configure(false);
    load_operands(x.data(), max_k, b.data());
  }
  _tile_release();
  double check = 0;
  for (float v : y) check += v;
  printf("%f %f %f %f %f %f %f %f %f %f %g\n", ops / best[0] / 1e9, ops / best[4] / 1e9, ops / best[1] / 1e9,
         ops / best[2] / 1e9, ops / best[3] / 1e9, ops / best[5] / 1e9, ops / best[6] / 1e9,
         ops / best[7] / 1e9, ops / best[8] / 1e9, ops / best[9] / 1e9, check);
}
"""


def build_loops(folder: str) -> str:
    """The loops program, built in `folder`; its path."""
    src, exe = os.path.join(folder, "loops.cpp"), os.path.join(folder, "loops")
    with open(src, "w") as f:
        f.write(LOOPS)
    subprocess.run(["c++", "-O2", "-march=sapphirerapids", "-std=c++17", src, "-o", exe], check=True)
    return exe


def tile_loops(exe: str, rows: int, reps: int) -> tuple[float, ...] | None:
    """GOP/s on one thread: (multiplies at 32 inputs, at 64, the tile sequence, with int8's float
    steps, with int4's, int4's with activations scaled per row, int8's with activations scaled
    per 64 and per 192 inputs); None where the kernel refuses the tile registers."""
    shape_args = [str(v) for n_k in SHAPES.values() for v in n_k]
    out = subprocess.run([exe, str(rows), str(reps), *shape_args], check=True, capture_output=True, text=True)
    if out.stdout.strip() == "refused":
        return None
    return tuple(float(v) for v in out.stdout.split()[:10])


def kernels(rows: int, reps: int) -> tuple[float, float]:
    """GOP/s of int8_mm and int4_mm over the four shapes (the sum of their best times), one
    thread."""
    import torch

    from kvserve.model.layers import quant_kernels as qk
    from kvserve.model.layers.quantization import quantize_weight

    mod = qk.kernels_for(qk.selected_variant())
    t8 = t4 = ops = 0.0
    for n, k in SHAPES.values():
        q8 = quantize_weight(torch.randn(n, k) * 0.1, "int8")
        codes8, scales8 = qk.pack_int8(q8.codes, q8.scales)
        q4 = quantize_weight(torch.randn(n, k) * 0.1, "int4")
        codes4, sz = qk.pack_int4(q4.codes, q4.scales, q4.zeros)
        x = torch.randn(rows, k)
        t8 += best_seconds(lambda: mod.int8_mm(x, codes8, scales8, n), reps)  # noqa: B023
        t4 += best_seconds(lambda: mod.int4_mm(x, codes4, sz, n), reps)  # noqa: B023
        ops += 2 * rows * n * k
    return ops / t8 / 1e9, ops / t4 / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="activation rows (a multiple of 16)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the loops and the kernels")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# CPU flags: {flags}; load average {os.getloadavg()[0]:.2f}")
    if "amx_int8" not in open("/proc/cpuinfo").read().split():
        print("this machine has no AMX-INT8: nothing to measure")
        return 0
    if args.rows % 16:
        sys.exit(f"--rows {args.rows}: the tiles take 16 rows at a time; give a multiple of 16")
    import torch

    from kvserve.model.layers import quant_kernels as qk

    torch.set_num_threads(1)
    variant = qk.selected_variant()
    print(f"# one thread; kernels' variant {variant}, {args.rows} rows, shapes {list(SHAPES)}; GOP/s")
    heads = ["round", "multiplies alone, 32 inputs (64 inputs)", "tile sequence (of the multiplies)",
             "+ int8 float steps (of the sequence)", "+ int4 unpacking and float steps (of the sequence)",
             "int8_mm (of its ceiling)", "int4_mm (of its ceiling)",
             "int4 / int8: ceilings, kernels", "int4, activations per row (of int4's ceiling)",
             "int8, activations per 64 (of int8's)", "int8, per 192 (of int8's)",
             "2 x 2 blocked: int8 (of int8's), int4 (of int4's)"]  # fmt: skip
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_loops(tmp)
        for r in range(args.rounds):
            loops = tile_loops(exe, args.rows, args.reps)
            if loops is None:
                print("the kernel refused the tile registers (ARCH_REQ_XCOMP_PERM): nothing to measure")
                return 0
            mul32, mul64, seq, with8, with4, row4, coarse64, coarse192, blocked8, blocked4 = loops
            k8, k4 = kernels(args.rows, args.reps)
            cells = [f"{mul32:.0f} ({mul64:.0f})", f"{seq:.0f} ({seq / mul32:.0%})",
                     f"{with8:.0f} ({with8 / seq:.0%})", f"{with4:.0f} ({with4 / seq:.0%})",
                     f"{k8:.0f} ({k8 / with8:.0%})", f"{k4:.0f} ({k4 / with4:.0%})",
                     f"{with4 / with8:.2f}x, {k4 / k8:.2f}x", f"{row4:.0f} ({row4 / with4:.2f}x)",
                     f"{coarse64:.0f} ({coarse64 / with8:.2f}x)",
                     f"{coarse192:.0f} ({coarse192 / with8:.2f}x)",
                     f"{blocked8:.0f} ({blocked8 / with8:.2f}x), "
                     f"{blocked4:.0f} ({blocked4 / with4:.2f}x)"]  # fmt: skip
            print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
