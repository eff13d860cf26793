// y = x @ W.T for kvserve's int4 weights, fp32 activations in and out, on the CPU.
//
// Weight layout (repacked once at load by QuantizedLinear, same bytes as before):
//   codes  uint8 [N, K / 2]: per group of 32 inputs, 16 bytes; byte j holds code j in its
//          low nibble and code j + 16 in its high one, so one AND and one shift give the
//          group's first and second halves in order;
//   sz     bfloat16 [N, K / 32, 2]: (scale, zero) per group, w = (q - 8) * scale + zero.
// Row-major by output row: a GEMV streams each row's codes and scales front to back.
//
// Two arithmetics, chosen by the caller:
//   mode 0, weight-only: each group is dequantized to fp32 in registers and multiplied with
//          the fp32 activations (the exact weight-only result up to fp32 rounding);
//   mode 1, int8 activations (llama.cpp's Q4_1 x Q8 scheme): each activation row is
//          quantized per group of 32 to int8 with its own scale, the group dot products are
//          integer (AVX2 vpmaddubsw + vpmaddwd, AVX-512 VNNI vpdpbusd), then scaled:
//          sum_j w_j x_j ~= scale * dx * sum_j q_j qx_j + (zero - 8 scale) * dx * sum_j qx_j.
//
// The same file is compiled once per instruction set with explicit flags (never
// -march=native), and kvserve picks the variant this CPU can run: AVX-512 VNNI, AVX2 + FMA,
// or plain C++ (the compiler's baseline). Each thread takes a contiguous range of output
// rows; inside it, a tile of NR weight rows is unpacked once per group and used for MR
// activation rows, so batches reuse the unpacked weights from registers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVQ_AVX2 1
#endif

namespace {

constexpr int64_t G = 32;  // group size

inline float bf16(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const char* isa_name() {
#if defined(KVQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(KVQ_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// ---- activation quantization (mode 1): per row, per group of 32, symmetric int8 ----------

void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t g = 0; g < K / G; ++g) {
    const float* xg = x + g * G;
    int8_t* qg = q + g * G;
#if defined(KVQ_AVX2)
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    const float dg = mx / 127.0f;
    const __m256 inv = _mm256_set1_ps(dg > 0.0f ? 127.0f / mx : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest-even
    // Sum of the codes, then pack 32 x int32 -> 32 x int8 (packs interleave 128-bit lanes).
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), p8);
    d[g] = dg;
    s[g] = dg * static_cast<float>(_mm_cvtsi128_si32(s4));
#else
    float mx = 0.0f;
    for (int64_t i = 0; i < G; ++i) mx = std::max(mx, std::fabs(xg[i]));
    const float dg = mx / 127.0f;
    const float inv = dg > 0.0f ? 127.0f / mx : 0.0f;
    int sum = 0;
    for (int64_t i = 0; i < G; ++i) {
      const int v = static_cast<int>(std::nearbyint(xg[i] * inv));
      qg[i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[g] = dg;
    s[g] = dg * static_cast<float>(sum);
#endif
  }
}

// ---- weight-stream prefetch ------------------------------------------------------------
// A GEMV reads each weight once, so it runs at the speed weights arrive from memory (a
// layer's rows are not in cache when its turn comes). With the hardware prefetchers alone the
// vocabulary-sized int8 table streamed at ~11 of ~24 GB/s on an AVX-512 Xeon; asking for the
// lines PF_BYTES ahead of the row being multiplied took it to ~17 (bench_quant_stream.py).
constexpr int64_t PF_BYTES = 4096;

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Rows [n, n + rows) of a weight matrix of row_bytes per row and N rows, clamped to N.
inline void prefetch_rows(const void* base, int64_t row_bytes, int64_t n, int64_t rows, int64_t N) {
  if (n >= N) return;
  rows = std::min(rows, N - n);
  prefetch_span(static_cast<const char*>(base) + n * row_bytes, rows * row_bytes);
}

// ---- tiles -----------------------------------------------------------------------------

struct Args {
  const uint8_t* w;     // [N, K/2]
  const uint16_t* sz;   // [N, K/32, 2]
  int64_t N, K;
  const float* x;       // [M, K] (mode 0)
  const int8_t* qx;     // [M, K] (mode 1)
  const float* dx;      // [M, K/32]
  const float* sx;      // [M, K/32]
  float* y;             // [M, N]
  const int8_t* w8 = nullptr;     // int8 weights [N, K] (int8_mm)
  const uint16_t* s8 = nullptr;   // their bf16 scale per row [N]
};

#if defined(KVQ_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A group's 16 code bytes -> 32 unsigned codes in input order.
inline __m256i unpack32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// 8 int32 partial sums of 32 u8 x s8 products.
inline __m256i dot32(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));  // <= 3810: no saturation
#endif
}

template <int NR, int MR>
void tile_i8(const Args& a, int64_t n0, int64_t m0) {
  const int64_t ng = a.K / G, kb = a.K / 2;
  __m256 acc[NR][MR];
  float bias[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < MR; ++c) acc[r][c] = _mm256_setzero_ps(), bias[r][c] = 0.0f;
  for (int64_t g = 0; g < ng; ++g) {
    __m256i w[NR];
    float sw[NR], mw[NR];
    for (int r = 0; r < NR; ++r) {
      w[r] = unpack32(a.w + (n0 + r) * kb + g * 16);
      const uint16_t* p = a.sz + ((n0 + r) * ng + g) * 2;
      sw[r] = bf16(p[0]);
      mw[r] = bf16(p[1]) - 8.0f * sw[r];
    }
    for (int c = 0; c < MR; ++c) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qx + (m0 + c) * a.K + g * G));
      const float d = a.dx[(m0 + c) * ng + g], s = a.sx[(m0 + c) * ng + g];
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w[r], xv)), _mm256_set1_ps(sw[r] * d), acc[r][c]);
        bias[r][c] += mw[r] * s;
      }
    }
  }
  for (int c = 0; c < MR; ++c)
    for (int r = 0; r < NR; ++r) a.y[(m0 + c) * a.N + n0 + r] = hsum(acc[r][c]) + bias[r][c];
}

template <int MR>
void tile_f32(const Args& a, int64_t n, int64_t m0) {
  const int64_t ng = a.K / G, kb = a.K / 2;
  __m256 acc[MR][2];
  for (int c = 0; c < MR; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  for (int64_t g = 0; g < ng; ++g) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.w + n * kb + g * 16));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);  // q - 8, exact in int8
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
    const uint16_t* p = a.sz + (n * ng + g) * 2;
    const __m256 s = _mm256_set1_ps(bf16(p[0])), z = _mm256_set1_ps(bf16(p[1]));
    __m256 w[4];
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s, z);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s, z);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s, z);
    for (int c = 0; c < MR; ++c) {
      const float* xp = a.x + (m0 + c) * a.K + g * G;
      acc[c][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp + 8), acc[c][1]);
      acc[c][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp + 16), acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp + 24), acc[c][1]);
    }
  }
  for (int c = 0; c < MR; ++c) a.y[(m0 + c) * a.N + n] = hsum(_mm256_add_ps(acc[c][0], acc[c][1]));
}
// Weight-only, many rows: a block of 16 weight rows is dequantized once into a row-major
// fp32 buffer (L1/L2-resident), then MR x NR dot-product tiles run over it with every
// activation row, so the dequantization is paid once per call rather than once per row.
constexpr int64_t NB = 16;

void dequant_row(const Args& a, int64_t n, float* out) {
  const int64_t ng = a.K / G, kb = a.K / 2;
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  for (int64_t g = 0; g < ng; ++g) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.w + n * kb + g * 16));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, mask), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), eight);
    const uint16_t* p = a.sz + (n * ng + g) * 2;
    const __m256 s = _mm256_set1_ps(bf16(p[0])), z = _mm256_set1_ps(bf16(p[1]));
    float* o = out + g * G;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s, z));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s, z));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s, z));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s, z));
  }
}

template <int MR>
void tile_panel(const Args& a, const float* T, int64_t n0, int64_t m0) {
  constexpr int NR = 4;
  __m256 acc[MR][NR];
  for (int c = 0; c < MR; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 8) {
    __m256 xv[MR];
    for (int c = 0; c < MR; ++c) xv[c] = _mm256_loadu_ps(a.x + (m0 + c) * a.K + k);
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = _mm256_loadu_ps(T + r * a.K + k);
      for (int c = 0; c < MR; ++c) acc[c][r] = _mm256_fmadd_ps(xv[c], wv, acc[c][r]);
    }
  }
  for (int c = 0; c < MR; ++c)
    for (int r = 0; r < NR; ++r) a.y[(m0 + c) * a.N + n0 + r] = hsum(acc[c][r]);
}

// int8 per-row weights, weight-only: codes widened to fp32 (exact), row scale applied last.
void dequant_row_i8(const Args& a, int64_t n, float* out) {
  const __m256 s = _mm256_set1_ps(bf16(a.s8[n]));
  const int8_t* w = a.w8 + n * a.K;
  for (int64_t k = 0; k < a.K; k += 8) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
  }
}

template <int MR>
void tile_i8w(const Args& a, int64_t n, int64_t m0) {
  __m256 acc[MR][2];
  for (int c = 0; c < MR; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const int8_t* w = a.w8 + n * a.K;
  int64_t k = 0;
  for (; k + 16 <= a.K; k += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    for (int c = 0; c < MR; ++c) {
      const float* xp = a.x + (m0 + c) * a.K + k;
      acc[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), acc[c][1]);
    }
  }
  for (; k < a.K; k += 8) {
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k))));
    for (int c = 0; c < MR; ++c) acc[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a.x + (m0 + c) * a.K + k), acc[c][0]);
  }
  const float s = bf16(a.s8[n]);
  for (int c = 0; c < MR; ++c) a.y[(m0 + c) * a.N + n] = hsum(_mm256_add_ps(acc[c][0], acc[c][1])) * s;
}

#if defined(__AVX512F__)
// AVX-512: the panel is turned k-major ([K][16]: the 16 weight rows' values at each k side by
// side), so one 512-bit FMA multiplies an activation (broadcast) into 16 outputs at once: a tile
// of PANEL_MR activation rows x 16 weight rows keeps PANEL_MR accumulators, needs no horizontal
// sums, and stores each row's 16 outputs in one go. Each output still sums its K products in
// order in fp32, so a row's result does not depend on how many rows share the call.
constexpr int PANEL_MR = 8;
// Turning the panel costs a pass over it, which pays back only over enough activation rows
// (bench_quant_native.py: slower than the 256-bit tiles at 8 rows, faster from 32).
constexpr int64_t KMAJOR_MIN_ROWS = 16;

// dst[j * 16 + i] = src[i * ld + j] for a 16 x 16 block (dst 64-byte aligned).
inline void transpose16(const float* src, int64_t ld, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {  // r[i + c]: rows i..i+3 of columns c, c + 4, c + 8, c + 12
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // rows 0-7 and 8-15 of columns (c, c + 8) and (c + 4, c + 12)
    t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0xdd);
    t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0xdd);
  }
  for (int c = 0; c < 8; ++c) {  // whole columns c and c + 8
    _mm512_store_ps(dst + c * 16, _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88));
    _mm512_store_ps(dst + (c + 8) * 16, _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd));
  }
}

template <int MR>
void tile_panel16(const Args& a, const float* Tt, int64_t n0, int64_t m0) {
  __m512 acc[MR];
  for (int c = 0; c < MR; ++c) acc[c] = _mm512_setzero_ps();
  const float* x = a.x + m0 * a.K;
  for (int64_t k = 0; k < a.K; ++k) {
    const __m512 w = _mm512_load_ps(Tt + k * 16);
    for (int c = 0; c < MR; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(x[c * a.K + k]), w, acc[c]);
  }
  for (int c = 0; c < MR; ++c) _mm512_storeu_ps(a.y + (m0 + c) * a.N + n0, acc[c]);
}

template <int MR>
void tail_panel16(const Args& a, const float* Tt, int64_t n0, int64_t m0, int64_t rows) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile_panel16<MR>(a, Tt, n0, m0);
    tail_panel16<MR - 1>(a, Tt, n0, m0, rows);
  }
}
#endif

// Rows [n0, n1) by panels of NB; a partial last panel goes row by row.
template <bool I8>
void rows_panel(const Args& a, int64_t M, int64_t n0, int64_t n1) {
  thread_local std::vector<float> T;
  T.resize(NB * a.K);
#if defined(__AVX512F__)
  thread_local std::vector<float> kmajor;  // 64-byte aligned view below
  const bool wide = a.K % 16 == 0 && M >= KMAJOR_MIN_ROWS;
  if (wide) kmajor.resize(NB * a.K + 16);
  float* const Tt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kmajor.data()) + 63) & ~uintptr_t(63));
#endif
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    for (int64_t r = 0; r < NB; ++r) {
      if constexpr (I8) dequant_row_i8(a, n + r, T.data() + r * a.K);
      else dequant_row(a, n + r, T.data() + r * a.K);
    }
#if defined(__AVX512F__)
    if (wide) {
      for (int64_t k = 0; k < a.K; k += 16) transpose16(T.data() + k, a.K, Tt + k * 16);
      int64_t m = 0;
      for (; m + PANEL_MR <= M; m += PANEL_MR) tile_panel16<PANEL_MR>(a, Tt, n, m);
      if (m < M) tail_panel16<PANEL_MR - 1>(a, Tt, n, m, M - m);
      continue;
    }
#endif
    int64_t m = 0;
    for (; m + 3 <= M; m += 3)
      for (int64_t r = 0; r < NB; r += 4) tile_panel<3>(a, T.data() + r * a.K, n + r, m);
    for (int64_t r = 0; r < NB && m < M; r += 4) {
      if (M - m == 2) tile_panel<2>(a, T.data() + r * a.K, n + r, m);
      else tile_panel<1>(a, T.data() + r * a.K, n + r, m);
    }
  }
  for (; n < n1; ++n) {
    int64_t m = 0;
    if constexpr (I8) {
      for (; m + 4 <= M; m += 4) tile_i8w<4>(a, n, m);
      for (; m < M; ++m) tile_i8w<1>(a, n, m);
    } else {
      for (; m + 4 <= M; m += 4) tile_f32<4>(a, n, m);
      for (; m < M; ++m) tile_f32<1>(a, n, m);
    }
  }
}
#else
// Plain C++: the same arithmetic, one (row, column) at a time.
template <int NR, int MR>
void tile_i8(const Args& a, int64_t n0, int64_t m0) {
  const int64_t ng = a.K / G, kb = a.K / 2;
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < MR; ++c) {
      float acc = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* wp = a.w + (n0 + r) * kb + g * 16;
        const int8_t* xp = a.qx + (m0 + c) * a.K + g * G;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (wp[j] & 15) * xp[j] + (wp[j] >> 4) * xp[j + 16];
        const uint16_t* p = a.sz + ((n0 + r) * ng + g) * 2;
        const float sw = bf16(p[0]), mw = bf16(p[1]) - 8.0f * sw;
        const int64_t i = (m0 + c) * ng + g;
        acc += static_cast<float>(dot) * sw * a.dx[i] + mw * a.sx[i];
      }
      a.y[(m0 + c) * a.N + n0 + r] = acc;
    }
}

template <int MR>
void tile_f32(const Args& a, int64_t n, int64_t m0) {
  const int64_t ng = a.K / G, kb = a.K / 2;
  float w[G];
  float acc[MR] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wp = a.w + n * kb + g * 16;
    const uint16_t* p = a.sz + (n * ng + g) * 2;
    const float s = bf16(p[0]), z = bf16(p[1]);
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>((wp[j] & 15) - 8) * s + z;
      w[j + 16] = static_cast<float>((wp[j] >> 4) - 8) * s + z;
    }
    for (int c = 0; c < MR; ++c) {
      const float* xp = a.x + (m0 + c) * a.K + g * G;
      for (int j = 0; j < G; ++j) acc[c] += w[j] * xp[j];
    }
  }
  for (int c = 0; c < MR; ++c) a.y[(m0 + c) * a.N + n] = acc[c];
}
#endif

#if !defined(KVQ_AVX2)
template <int MR>
void tile_i8w(const Args& a, int64_t n, int64_t m0) {
  const int8_t* w = a.w8 + n * a.K;
  const float s = bf16(a.s8[n]);
  for (int c = 0; c < MR; ++c) {
    const float* xp = a.x + (m0 + c) * a.K;
    float acc = 0.0f;
    for (int64_t k = 0; k < a.K; ++k) acc += static_cast<float>(w[k]) * xp[k];
    a.y[(m0 + c) * a.N + n] = acc * s;
  }
}
#endif

// Rows [n0, n1) of the output for all M activation rows.
template <int NR>
void rows_i8(const Args& a, int64_t M, int64_t n0, int64_t n1) {
  const int64_t code_bytes = a.K / 2, sz_bytes = a.K / G * 4;
  const int64_t ahead = std::max<int64_t>(NR, PF_BYTES / code_bytes);
  prefetch_rows(a.w, code_bytes, n0, ahead, n1);  // the range's start: no earlier row asked for it
  prefetch_rows(a.sz, sz_bytes, n0, ahead, n1);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    prefetch_rows(a.w, code_bytes, n + ahead, NR, a.N);
    prefetch_rows(a.sz, sz_bytes, n + ahead, NR, a.N);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_i8<NR, 4>(a, n, m);
    switch (M - m) {
      case 3: tile_i8<NR, 3>(a, n, m); break;
      case 2: tile_i8<NR, 2>(a, n, m); break;
      case 1: tile_i8<NR, 1>(a, n, m); break;
      default: break;
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) tile_i8<1, 1>(a, n, m);
}

void rows_f32(const Args& a, int64_t M, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_f32<4>(a, n, m);
    switch (M - m) {
      case 3: tile_f32<3>(a, n, m); break;
      case 2: tile_f32<2>(a, n, m); break;
      case 1: tile_f32<1>(a, n, m); break;
      default: break;
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N, K/2]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % G == 0 && codes.size(1) * 2 == K, "K must be a multiple of 32 matching codes");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == codes.size(0) * (K / G) * 2,
              "sz: contiguous bfloat16 [N, K/32, 2]");
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t mode) {
  check(x, codes, sz);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Args a{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()), N, K,
         x.data_ptr<float>(), nullptr, nullptr, nullptr, y.data_ptr<float>()};
  std::vector<int8_t> qx;
  std::vector<float> dx, sx;
  if (mode == 1) {
    qx.resize(M * K);
    dx.resize(M * (K / G));
    sx.resize(M * (K / G));
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        quantize_row(a.x + m * K, K, qx.data() + m * K, dx.data() + m * (K / G), sx.data() + m * (K / G));
    });
    a.qx = qx.data(), a.dx = dx.data(), a.sx = sx.data();
  }
  // Work unit: 16 output rows (a multiple of every tile width); a thread's units are contiguous.
  const int64_t units = (N + 15) / 16;
  at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * 16, n1 = std::min(N, e * 16);
    if (mode == 1 && M == 1)
      rows_i8<4>(a, M, n0, n1);
    else if (mode == 1)
      rows_i8<2>(a, M, n0, n1);
#if defined(KVQ_AVX2)
    else if (M >= 4)
      rows_panel<false>(a, M, n0, n1);
#endif
    else
      rows_f32(a, M, n0, n1);
  });
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(codes.size(1) == x.size(1) && x.size(1) % 8 == 0, "K must match and be a multiple of 8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == codes.size(0),
              "scales: bfloat16 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Args a{nullptr, nullptr, N, K, x.data_ptr<float>(), nullptr, nullptr, nullptr, y.data_ptr<float>(),
         codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>())};
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * 16, n1 = std::min(N, e * 16);
#if defined(KVQ_AVX2)
    if (M >= 4) {
      rows_panel<true>(a, M, n0, n1);
      return;
    }
#endif
    const int64_t ahead = std::max<int64_t>(1, PF_BYTES / K);
    prefetch_rows(a.w8, K, n0, ahead, n1);
    for (int64_t n = n0; n < n1; ++n) {
      prefetch_rows(a.w8, K, n + ahead, 1, N);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile_i8w<4>(a, n, m);
      for (; m < M; ++m) tile_i8w<1>(a, n, m);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "y = x @ W.T, W int4 (kvserve layout); mode 0 weight-only fp32, 1 int8 activations");
  m.def("int8_mm", &int8_mm, "y = x @ W.T, W int8 with a bf16 scale per row; weight-only fp32");
  m.def("isa", &isa_name, "the instruction set this variant was compiled for");
}
