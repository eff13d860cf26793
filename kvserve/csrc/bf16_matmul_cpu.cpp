// bfloat16 weights in 16-row panels, multiplied with AVX512-BF16 dot products (issue 16).
//
// On a CPU with avx512_bf16 but no AMX (AMD Zen 4, Intel Cooper Lake) oneDNN's packed bf16
// linear ran a one-row decode step at ~13 GB/s of weights, no faster than four rows: a
// 2-core Zen 4 read its bf16 projections in 17.6 ms where memory allows ~7 (docs/BENCHMARKS.md
// round 21). Here one `vdpbf16ps` multiplies an input pair into all 16 rows of a panel, so one
// row streams the weights once, and a tile of rows reuses each 64-byte load many times: the
// same "one lane per output" shape as the int8 panels of quant_matmul_cpu.cpp.
//
// Layout (bf16_panels.py's panel_layout): uint16 [P, K/2, 32]; in panel p, chunk j, element
// 2r + i is row 16p + r's weight for input 2j + i. Each output is one lane summing its input
// pairs in order, whatever the tile or thread: the same bits for any batch or split.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PR = 16;  // output rows per panel
constexpr int TILE_M = 12;  // activation rows per tile: 12 x 2 accumulators + 2 weights + 1 broadcast

struct Args {
  const uint16_t* w;  // panels [P, K/2, 32]
  const uint16_t* x;  // [M, K]
  const uint16_t* bias;  // [N] or null
  uint16_t* y;  // [M, N]
  int64_t K, N;
};

inline __m512 bias16(const uint16_t* b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Rows [m0, m0 + R) x panels [p, p + NP).
template <int R, int NP>
void tile(const Args& a, int64_t p, int64_t m0) {
  const int64_t pairs = a.K / 2, stride = pairs * 32;
  const uint16_t* w = a.w + p * stride;
  __m512 acc[R][NP];
  for (int c = 0; c < R; ++c)
    for (int n = 0; n < NP; ++n) acc[c][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wv[NP];
    for (int n = 0; n < NP; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * stride + j * 32);
    for (int c = 0; c < R; ++c) {
      int32_t pair;
      std::memcpy(&pair, a.x + (m0 + c) * a.K + 2 * j, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < NP; ++n) acc[c][n] = _mm512_dpbf16_ps(acc[c][n], wv[n], xb);
    }
  }
  for (int n = 0; n < NP; ++n) {
    const int64_t n0 = (p + n) * PR;
    const __m512 b = a.bias ? bias16(a.bias + n0) : _mm512_setzero_ps();
    for (int c = 0; c < R; ++c) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[c][n], b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + (m0 + c) * a.N + n0), (__m256i)out);
    }
  }
}

template <int NP>
void rows_tail(const Args& a, int64_t p, int64_t m0, int64_t r) {
  switch (r) {
    case 1: return tile<1, NP>(a, p, m0);
    case 2: return tile<2, NP>(a, p, m0);
    case 3: return tile<3, NP>(a, p, m0);
    case 4: return tile<4, NP>(a, p, m0);
    case 5: return tile<5, NP>(a, p, m0);
    case 6: return tile<6, NP>(a, p, m0);
    case 7: return tile<7, NP>(a, p, m0);
    case 8: return tile<8, NP>(a, p, m0);
    case 9: return tile<9, NP>(a, p, m0);
    case 10: return tile<10, NP>(a, p, m0);
    case 11: return tile<11, NP>(a, p, m0);
    default: return tile<TILE_M, NP>(a, p, m0);
  }
}

// Panels [p, p + NP) for every row: the panels' weights stay in cache while the rows pass.
template <int NP>
void panel_rows(const Args& a, int64_t M, int64_t p) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) rows_tail<NP>(a, p, m0, std::min<int64_t>(TILE_M, M - m0));
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
              panels.size(2) == 32, "panels: contiguous bfloat16 [P, K/2, 32]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * PR;
  TORCH_CHECK(panels.size(1) * 2 == K, "x has ", K, " columns, the panels ", panels.size(1) * 2);
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias: contiguous bfloat16 [N]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Args a{reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), b,
               reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), K, N};
  // Work unit: two adjacent panels (32 outputs); an odd last panel goes alone.
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t s, int64_t e) {
    for (int64_t q = s; q < e; ++q) {
      if (2 * q + 1 < P)
        panel_rows<2>(a, M, 2 * q);
      else
        panel_rows<1>(a, M, 2 * q);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_mm", &bf16_mm, "y = x @ W.T + bias in bfloat16, W in 16-row panels of input pairs (AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias") = pybind11::none());
}
