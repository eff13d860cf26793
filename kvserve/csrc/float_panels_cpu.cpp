// float32 and bfloat16 weights in 16-row panels, multiplied with AVX-512 (issue 16).
//
// On an AVX-512 CPU without AMX (AMD Zen 4) oneDNN's packed linear read a one-row decode step's
// weights at ~20 GB/s in fp32 and ~13 GB/s in bf16, and four rows were little faster: a 2-core
// Zen 4 read its bf16 projections in 17.6 ms where memory allows ~7 (docs/BENCHMARKS.md round
// 21). Here each 64-byte chunk of a panel holds one 32-bit slot of all 16 rows (fp32: one input;
// bf16: an input pair), so one FMA or `vdpbf16ps` with a broadcast input feeds 16 outputs: one
// row streams the weights once, and a tile of rows reuses each load many times, the "one lane
// per output" shape of quant_matmul_cpu.cpp's int8 panels.
//
// Layout (float_panels.py's panel_layout): [P, K / g, 16 g] with g = 4 / element size; in panel
// p, chunk j, element g r + i is row 16p + r's weight for input g j + i. Each output is one lane
// summing its inputs in order, whatever the tile or thread: the same bits for any batch or split.
// Built twice: with -mavx512bf16 (both kernels) and without (fp32 only), loaded per CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t PR = 16;  // output rows per panel
constexpr int TILE_M = 12;  // activation rows per tile: 12 x 2 accumulators + 2 weights + 1 broadcast

template <typename T>
struct Args {
  const T* w;  // panels [P, K / g, 16 g]
  const T* x;  // [M, K]
  const T* bias;  // [N] or null
  T* y;  // [M, N]
  int64_t K, N;
};

#if defined(__AVX512BF16__)
inline __m512 bf16x16(const at::BFloat16* b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// acc += the chunk's 16 rows x one input pair of x (two bf16 in one 32-bit broadcast).
inline __m512 step(__m512 acc, __m512i w, const at::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}
#endif

inline __m512 step(__m512 acc, __m512i w, const float* x) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_set1_ps(*x), acc);
}

// Rows [m0, m0 + R) x panels [p, p + NP).
template <typename T, int R, int NP>
void tile(const Args<T>& a, int64_t p, int64_t m0) {
  constexpr int64_t g = 4 / sizeof(T);
  const int64_t chunks = a.K / g, stride = chunks * PR * g;
  const T* w = a.w + p * stride;
  __m512 acc[R][NP];
  for (int c = 0; c < R; ++c)
    for (int n = 0; n < NP; ++n) acc[c][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < chunks; ++j) {
    __m512i wv[NP];
    for (int n = 0; n < NP; ++n) wv[n] = _mm512_loadu_si512(w + n * stride + j * PR * g);
    for (int c = 0; c < R; ++c)
      for (int n = 0; n < NP; ++n) acc[c][n] = step(acc[c][n], wv[n], a.x + (m0 + c) * a.K + g * j);
  }
  for (int n = 0; n < NP; ++n) {
    const int64_t n0 = (p + n) * PR;
    for (int c = 0; c < R; ++c) {
      T* out = a.y + (m0 + c) * a.N + n0;
      if constexpr (std::is_same_v<T, float>) {
        const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
        _mm512_storeu_ps(out, _mm512_add_ps(acc[c][n], b));
      } else {
#if defined(__AVX512BF16__)
        const __m512 b = a.bias ? bf16x16(a.bias + n0) : _mm512_setzero_ps();
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[c][n], b));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)v);
#endif
      }
    }
  }
}

template <typename T, int NP>
void rows_tail(const Args<T>& a, int64_t p, int64_t m0, int64_t r) {
  switch (r) {
    case 1: return tile<T, 1, NP>(a, p, m0);
    case 2: return tile<T, 2, NP>(a, p, m0);
    case 3: return tile<T, 3, NP>(a, p, m0);
    case 4: return tile<T, 4, NP>(a, p, m0);
    case 5: return tile<T, 5, NP>(a, p, m0);
    case 6: return tile<T, 6, NP>(a, p, m0);
    case 7: return tile<T, 7, NP>(a, p, m0);
    case 8: return tile<T, 8, NP>(a, p, m0);
    case 9: return tile<T, 9, NP>(a, p, m0);
    case 10: return tile<T, 10, NP>(a, p, m0);
    case 11: return tile<T, 11, NP>(a, p, m0);
    default: return tile<T, TILE_M, NP>(a, p, m0);
  }
}

// Panels [p, p + NP) for every row: the panels' weights stay in cache while the rows pass.
template <typename T, int NP>
void panel_rows(const Args<T>& a, int64_t M, int64_t p) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) rows_tail<T, NP>(a, p, m0, std::min<int64_t>(TILE_M, M - m0));
}

template <typename T>
at::Tensor panel_mm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                    at::ScalarType dtype, const char* name) {
  constexpr int64_t g = 4 / sizeof(T);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous(), "x: contiguous ", name, " [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == dtype && panels.is_contiguous() &&
              panels.size(2) == PR * g, "panels: contiguous ", name, " [P, K/", g, ", ", PR * g, "]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * PR;
  TORCH_CHECK(panels.size(1) * g == K, "x has ", K, " columns, the panels ", panels.size(1) * g);
  const T* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous ", name, " [N]");
    b = bias->data_ptr<T>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Args<T> a{panels.data_ptr<T>(), x.data_ptr<T>(), b, y.data_ptr<T>(), K, N};
  // Work unit: two adjacent panels (32 outputs); an odd last panel goes alone.
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t s, int64_t e) {
    for (int64_t q = s; q < e; ++q) {
      if (2 * q + 1 < P)
        panel_rows<T, 2>(a, M, 2 * q);
      else
        panel_rows<T, 1>(a, M, 2 * q);
    }
  });
  return y;
}

at::Tensor fp32_mm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  return panel_mm<float>(x, panels, bias, at::kFloat, "float32");
}

#if defined(__AVX512BF16__)
at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  return panel_mm<at::BFloat16>(x, panels, bias, at::kBFloat16, "bfloat16");
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp32_mm", &fp32_mm, "y = x @ W.T + bias in float32, W in 16-row panels (AVX-512)", pybind11::arg("x"),
        pybind11::arg("panels"), pybind11::arg("bias") = pybind11::none());
#if defined(__AVX512BF16__)
  m.def("bf16_mm", &bf16_mm, "y = x @ W.T + bias in bfloat16, W in 16-row panels of input pairs (AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias") = pybind11::none());
#endif
}
