// y = x @ W.T for kvserve's int4 and int8 weights, fp32 activations in and out, on the CPU.
//
// int4 weight layout (built once at load by quant_kernels.pack_int4): panels of 16 output rows,
// k-major, so one 512-bit VNNI dot product feeds 16 outputs at once and needs no horizontal sums.
//   codes  uint8 [P, K / 8, 64], P = ceil(N / 16) (the last panel padded with zero codes): in
//          panel p, chunk j (inputs 8j .. 8j + 7), byte 4r + i holds row 16p + r's code for input
//          8j + i in its low nibble and for input 8j + 4 + i in its high one (i = 0..3);
//   sz     bfloat16 [P, K / 32, 2, 16]: per panel and group of 32 inputs, the 16 rows' scales,
//          then their zeros; w = (q - 8) * scale + zero. Same bytes as a row-major layout.
// (llama.cpp's repacked Q4_0 x 8 rows is the same idea for its GEMV and GEMM.)
//
// Arithmetic (llama.cpp's Q4_1 x Q8 scheme): each activation row is quantized per group of 32
// to int8 with its own scale dx (and sx = dx * sum of its codes); per output, group by group in
// order, every variant computes
//   isum = sum_j q_j qx_j                      (exact in int32)
//   acc  = fma(float(isum), scale * dx, acc)    bias = fma(zero - 8 scale, sx, bias)
// and stores acc + bias. One output is one SIMD lane whatever the row count, so a row's result
// is bit-identical alone or in a batch of 64, and in a prefill chunk of any length.
//
// int8 weights (a bf16 scale per row) take the same panels, activations and order; see below.
//
// The file is compiled once per instruction set with explicit flags (never -march=native), and
// kvserve picks the variant this CPU can run: AVX-512 VNNI, AVX2 + FMA, or plain C++.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
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
#if defined(KVQ_AVX2) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
  return "avx512_amx";
#elif defined(KVQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(KVQ_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// ---- activation quantization: per row, per group of 32, symmetric int8 --------------------

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Lane i of the result: op over the 16 lanes of v[i] (op associative and commutative). Pairs,
// then quads, of registers are folded into each other's lanes, so 16 reductions take 15 x 3
// shuffles and ops instead of 16 separate chains of 8.
template <class Op>
inline __m512 fold16(const __m512* v, Op op) {
  __m512 quad[4];
  for (int i = 0; i < 4; ++i) {
    const __m512* r = v + 4 * i;
    const __m512 s01 = op(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
    const __m512 s23 = op(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
    const __m512d a = _mm512_castps_pd(s01), b = _mm512_castps_pd(s23);
    quad[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quad[i]'s 128-bit lane j: registers 4i..4i+3 folded over their lane j.
  const __m512 h01 = op(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44), _mm512_shuffle_f32x4(quad[0], quad[1], 0xEE));
  const __m512 h23 = op(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44), _mm512_shuffle_f32x4(quad[2], quad[3], 0xEE));
  return op(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// Groups [0, n) of a row, n <= 16, at once: their maxima folded together, the scales with one
// vector division each (the IEEE quotients the scalar divisions below make), the codes, and
// the code sums folded together (as floats: exact, |sum| <= 32 x 127). The same bits as the
// AVX2 loop for finite activations, whose two scalar divisions and horizontal steps a group made activation
// quantization 2-4% of a batched int4 decode step (perf, 64 rows, Zen 4); 64 rows of 576
// inputs take 6.2 us here against its 8.9, of 1536 14.2 against 22.7 (one thread, Zen 4;
// benchmarks/bench_activation_quant.py, docs/BENCHMARKS.md issue 16 round 25).
inline void quantize_groups16(const float* x, int64_t n, int8_t* q, float* d, float* s, int32_t* qsum) {
  __m512 part[16];
  for (int64_t g = 0; g < 16; ++g)
    part[g] = g < n ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + g * G)),
                                    _mm512_abs_ps(_mm512_loadu_ps(x + g * G + 16)))
                    : _mm512_setzero_ps();
  const __m512 mx = fold16(part, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  const __m512 dg = _mm512_div_ps(mx, _mm512_set1_ps(127.0f));
  const __mmask16 positive = _mm512_cmp_ps_mask(dg, _mm512_setzero_ps(), _CMP_GT_OQ);
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), mx));  // 0 where dg is 0
  for (int64_t g = 0; g < 16; ++g) {
    if (g >= n) {
      part[g] = _mm512_setzero_ps();
      continue;
    }
    const __m512 iv = _mm512_set1_ps(inv[g]);
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + g * G), iv));  // nearest-even
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + g * G + 16), iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * G), _mm512_cvtsepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * G + 16), _mm512_cvtsepi32_epi8(b));
    part[g] = _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
  }
  const __m512 total = fold16(part, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  _mm512_mask_storeu_ps(d, keep, dg);
  _mm512_mask_storeu_epi32(qsum, keep, _mm512_cvtps_epi32(total));
  _mm512_mask_storeu_ps(s, keep, _mm512_mul_ps(dg, total));
}

// One group alone (a row's last few, where a fold of 16 would mostly fold zeros): the same
// steps with a reduction of its own for the maximum and the sum, so the same bits.
inline void quantize_group(const float* x, int8_t* q, float* d, float* s, int32_t* qsum) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dg = mx / 127.0f;
  const __m512 iv = _mm512_set1_ps(dg > 0.0f ? 127.0f / mx : 0.0f);
  const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)), b = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(b));
  *d = dg;
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  *s = dg * static_cast<float>(*qsum);
}

void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
  constexpr int64_t kFoldMin = 6;  // fewer groups left: one at a time
  const int64_t ng = K / G;
  int64_t g = 0;
  for (; ng - g >= kFoldMin; g += 16)
    quantize_groups16(x + g * G, std::min<int64_t>(16, ng - g), q + g * G, d + g, s + g, qsum + g);
  for (; g < ng; ++g) quantize_group(x + g * G, q + g * G, d + g, s + g, qsum + g);
}
#else
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
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
    qsum[g] = _mm_cvtsi128_si32(s4);
    s[g] = dg * static_cast<float>(qsum[g]);
#else
    float mx = 0.0f;
    for (int64_t i = 0; i < G; ++i) mx = std::max(mx, std::fabs(xg[i]));
    const float dg = mx / 127.0f;
    const float inv = dg > 0.0f ? 127.0f / mx : 0.0f;
    int total = 0;
    for (int64_t i = 0; i < G; ++i) {
      const int v = static_cast<int>(std::nearbyint(xg[i] * inv));
      qg[i] = static_cast<int8_t>(v);
      total += v;
    }
    d[g] = dg;
    qsum[g] = total;
    s[g] = dg * static_cast<float>(total);
#endif
  }
}
#endif

// ---- weight-stream prefetch ------------------------------------------------------------
// A GEMV reads each weight once, so it runs at the speed weights arrive from memory (a
// layer's rows are not in cache when its turn comes). With the hardware prefetchers alone the
// vocabulary-sized int8 table streamed at ~11 of ~24 GB/s on an AVX-512 Xeon; asking for the
// next panel while the current one runs (and for a thread's first PF_BYTES) took it to ~26
// (bench_quant_stream.py, docs/BENCHMARKS.md issue 16 rounds 9-10).
//
// The helpers are always inlined. GCC 12 did not inline prefetch_group_i4 early, judged it
// const (a prefetch has no effect it tracks) and deleted every call as unused: until issue 16
// round 28 no int4 panel (AVX2, VNNI or AMX build) asked for the next one.
constexpr int64_t PF_BYTES = 4096;

[[gnu::always_inline]] inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}


// ---- int4 x int8 activations on 16-row panels --------------------------------------------

struct Args {
  const uint8_t* w;     // int4 panels [P, K/8, 64]
  const uint16_t* sz;   // [P, K/32, 2, 16]
  int64_t N, K;
  const int8_t* qx;     // [M, K] activations quantized per group of 32: codes,
  const float* dx;      // [M, K/32] their scales,
  const float* sx;      // [M, K/32] scale * sum of the group's codes,
  const int32_t* xs;    // [M, K/32] sum of the group's codes
  float* y;             // [M, N]
  const int8_t* w8 = nullptr;     // int8 panels [P, K/4, 64] (int8_mm)
  const uint16_t* s8 = nullptr;   // their bf16 scale per row [P * 16]
  const int8_t* ax = nullptr;     // [M, K] |qx|: the AVX2 int8 tiles' u8 operand (panels sets it)
};

constexpr int64_t PR = 16;  // output rows per panel

// v grown to hold n elements from its first cache-line boundary, and that boundary. A buffer the
// tile loads read must start on a line, or rows of 32 and 64 bytes straddle two lines; malloc
// gives 16 bytes, so which process got aligned buffers was chance.
template <class T>
T* line_aligned(std::vector<T>& v, int64_t n) {
  constexpr int64_t pad = 64 / sizeof(T);
  if (static_cast<int64_t>(v.size()) < n + pad) v.resize(n + pad);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

inline int64_t panel_code_bytes(const Args& a) { return a.K / 8 * 64; }
inline int64_t panel_sz_elems(const Args& a) { return a.K / G * 2 * PR; }

// Group g of int4 panel p (its codes and scales), asked for while the panel before it runs.
[[gnu::always_inline]] inline void prefetch_group_i4(const Args& a, int64_t p, int64_t g) {
  prefetch_span(a.w + p * panel_code_bytes(a) + g * 256, 256);
  __builtin_prefetch(a.sz + p * panel_sz_elems(a) + g * 2 * PR, 0, 3);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int TILE_MR = 8;  // activation rows per tile: 8 x 3 accumulators + 2 weight registers

inline __m512 bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [m0, m0 + MR) x panel p; pf: prefetch panel p + 1 meanwhile.
template <int MR>
void panel_i4(const Args& a, int64_t p, int64_t m0, bool pf) {
  const int64_t ng = a.K / G;
  const uint8_t* w = a.w + p * panel_code_bytes(a);
  const uint16_t* sz = a.sz + p * panel_sz_elems(a);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[MR], bias[MR];
  for (int c = 0; c < MR; ++c) acc[c] = bias[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_i4(a, p + 1, g);
    __m512i isum[MR];
    for (int c = 0; c < MR; ++c) isum[c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + (g * 4 + j) * 64);
      const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      for (int c = 0; c < MR; ++c) {
        const int8_t* xq = a.qx + (m0 + c) * a.K + g * G + 8 * j;
        isum[c] = _mm512_dpbusd_epi32(isum[c], lo, bcast4(xq));
        isum[c] = _mm512_dpbusd_epi32(isum[c], hi, bcast4(xq + 4));
      }
    }
    const __m512 sw = bf16x16(sz + g * 2 * PR), zw = bf16x16(sz + g * 2 * PR + PR);
    const __m512 mw = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sw, zw);  // zero - 8 scale
    for (int c = 0; c < MR; ++c) {
      const int64_t i = (m0 + c) * ng + g;
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(sw, _mm512_set1_ps(a.dx[i])), acc[c]);
      bias[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sx[i]), bias[c]);
    }
  }
  const int64_t n0 = p * PR, valid = std::min(PR, a.N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int c = 0; c < MR; ++c) _mm512_mask_storeu_ps(a.y + (m0 + c) * a.N + n0, keep, _mm512_add_ps(acc[c], bias[c]));
}
#elif defined(KVQ_AVX2)
constexpr int TILE_MR = 3;  // 16 ymm registers: 3 x 3 accumulators + weights and broadcasts

inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The first `valid` of 8 outputs.
inline void store8(float* out, __m256 v, int64_t valid) {
  if (valid == 8) return _mm256_storeu_ps(out, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(out, tmp, valid * sizeof(float));
}

// Per int32 lane, the exact sum of 4 u8 x s8 products, for pairs that fit int16 (int8 weights
// with the signs moved: <= 2 * 127 * 127 = 32258).
inline __m256i dot4(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// One half (8 rows) of panel p: the first or second 32 bytes of each 64-byte chunk. With `u`,
// the codes come unpacked from there (unpack_half_i4's layout) rather than from the panel.
template <int MR>
void half_i4(const Args& a, int64_t p, int h, int64_t m0, bool pf, const uint8_t* u = nullptr) {
  const int64_t n0 = p * PR + h * 8, valid = std::min<int64_t>(8, a.N - n0);
  if (valid <= 0) return;
  const int64_t ng = a.K / G;
  const uint8_t* w = a.w + p * panel_code_bytes(a) + h * 32;
  const uint16_t* sz = a.sz + p * panel_sz_elems(a) + h * 8;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[MR], bias[MR];
  for (int c = 0; c < MR; ++c) acc[c] = bias[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_i4(a, p + 1, g);
    // int16 pair sums of the whole group: each vpmaddubsw pair is <= 2 * 15 * 127 = 3810, and
    // 8 of them add up to <= 30480 < 32767, so one vpmaddwd per group widens them exactly.
    __m256i s16[MR];
    for (int c = 0; c < MR; ++c) s16[c] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      if (u) {
        lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + (g * 4 + j) * 64));
        hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + (g * 4 + j) * 64 + 32));
      } else {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 4 + j) * 64));
        lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      for (int c = 0; c < MR; ++c) {
        const int8_t* xq = a.qx + (m0 + c) * a.K + g * G + 8 * j;
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)), _mm256_maddubs_epi16(hi, bcast4(xq + 4)));
        s16[c] = _mm256_add_epi16(s16[c], pairs);
      }
    }
    __m256i isum[MR];
    for (int c = 0; c < MR; ++c) isum[c] = _mm256_madd_epi16(s16[c], _mm256_set1_epi16(1));
    const __m256 sw = bf16x8(sz + g * 2 * PR), zw = bf16x8(sz + g * 2 * PR + PR);
    const __m256 mw = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sw, zw);  // zero - 8 scale
    for (int c = 0; c < MR; ++c) {
      const int64_t i = (m0 + c) * ng + g;
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_mul_ps(sw, _mm256_set1_ps(a.dx[i])), acc[c]);
      bias[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sx[i]), bias[c]);
    }
  }
  for (int c = 0; c < MR; ++c) store8(a.y + (m0 + c) * a.N + n0, _mm256_add_ps(acc[c], bias[c]), valid);
}

template <int MR>
void panel_i4(const Args& a, int64_t p, int64_t m0, bool pf) {
  half_i4<MR>(a, p, 0, m0, pf);
  half_i4<MR>(a, p, 1, m0, false);
}

// Half h of int4 panel p with its codes unpacked once for every row tile: per chunk, 32 bytes of
// low nibbles then 32 of high ones, the operands half_i4 makes with three instructions a chunk.
// Made per tile of 3 rows, they were one of its ~6 vector instructions per 64 products; read
// from L1 instead, the tiles also have the registers for 4 rows. 32 and 96 rows of the default
// model's shapes took 0.78-0.84x the time (one thread, AVX2 build on an Emerald Rapids; same
// bits: the same integer sums and float steps).
constexpr int UNPACKED_MR = 4;

const uint8_t* unpack_half_i4(const Args& a, int64_t p, int h) {
  static thread_local std::vector<uint8_t> buf;
  const int64_t chunks = a.K / 8;
  uint8_t* out = line_aligned(buf, chunks * 64);
  const uint8_t* w = a.w + p * panel_code_bytes(a) + h * 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * 64), _mm256_and_si256(v, mask));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + c * 64 + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
  }
  return out;
}

// Rows [m, M) of int4 panel p, half by half, each half's codes unpacked first.
void unpacked_rows_i4(const Args& a, int64_t p, int64_t m, int64_t M) {
  for (int h = 0; h < 2; ++h) {
    if (p * PR + h * 8 >= a.N) break;
    const uint8_t* u = unpack_half_i4(a, p, h);
    int64_t r = m;
    for (; r + UNPACKED_MR <= M; r += UNPACKED_MR) half_i4<UNPACKED_MR>(a, p, h, r, false, u);
    if (M - r == 3) half_i4<3>(a, p, h, r, false, u);
    if (M - r == 2) half_i4<2>(a, p, h, r, false, u);
    if (M - r == 1) half_i4<1>(a, p, h, r, false, u);
  }
}
#define KVQ_UNPACKED_I4 1
// The fewest rows that take unpacked_rows_i4 (0: never). kvserve sets it at load from a timing of
// both forms (quant_kernels.choose_int4_unpacked): on round 20's Zen 3 the same idea, measured in a
// standalone loop, ran at 0.83-0.88x the 3-row tile's speed.
int64_t unpacked_min_rows_i4 = UNPACKED_MR;
#else
constexpr int TILE_MR = 4;

// Plain C++: the same arithmetic, one output at a time (fma only where the compiler contracts).
template <int MR>
void panel_i4(const Args& a, int64_t p, int64_t m0, bool) {
  const int64_t ng = a.K / G, n0 = p * PR, valid = std::min(PR, a.N - n0);
  const uint8_t* w = a.w + p * panel_code_bytes(a);
  const uint16_t* sz = a.sz + p * panel_sz_elems(a);
  for (int c = 0; c < MR; ++c)
    for (int64_t r = 0; r < valid; ++r) {
      float acc = 0.0f, bias = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        const int8_t* xq = a.qx + (m0 + c) * a.K + g * G;
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = w[(g * 4 + j) * 64 + r * 4 + i];
            isum += (b & 15) * xq[8 * j + i] + (b >> 4) * xq[8 * j + 4 + i];
          }
        const float sw = bf16(sz[g * 2 * PR + r]), zw = bf16(sz[g * 2 * PR + PR + r]);
        const int64_t i = (m0 + c) * ng + g;
        acc += static_cast<float>(isum) * (sw * a.dx[i]);
        bias += (zw - 8.0f * sw) * a.sx[i];
      }
      a.y[(m0 + c) * a.N + n0 + r] = acc + bias;
    }
}
#endif

// ---- int8 weights x int8 activations on 16-row panels ------------------------------------
// Layout (quant_kernels.pack_int8): codes int8 [P, K / 4, 64], in panel p, chunk j (inputs
// 4j .. 4j + 3), byte 4r + i holds row 16p + r's code for input 4j + i; scales bf16 [P * 16],
// one per row (zero in the padding). Per output, group by group in order:
//   isum = sum_j q_j qx_j (exact in int32);  acc = fma(float(isum), dx, acc)
// and the output is acc * scale. As for int4, a row's result does not depend on the row count.
// |q| <= 127 on both sides, so AVX2's vpmaddubsw (u8 x s8 pairs into int16) cannot saturate
// once the signs are moved onto the weights (|x| x sign(x) w, llama.cpp's trick; the tiles of
// 2+ rows read |x| from a copy made once a call, Int8::rows); VNNI's vpdpbusd takes the weights
// as unsigned, q + 128, and subtracts 128 * sum(qx) afterwards.

inline const int8_t* panel8(const Args& a, int64_t p) { return a.w8 + p * a.K * PR; }

[[gnu::always_inline]] inline void prefetch_group_q8(const Args& a, int64_t p, int64_t g) {
  prefetch_span(panel8(a, p) + g * 512, 512);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
template <int MR>
void panel_q8(const Args& a, int64_t p, int64_t m0, bool pf) {
  const int64_t ng = a.K / G;
  const int8_t* w = panel8(a, p);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // q ^ 0x80 = q + 128 as u8
  __m512 acc[MR];
  for (int c = 0; c < MR; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_q8(a, p + 1, g);
    __m512i isum[MR];
    for (int c = 0; c < MR; ++c) isum[c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + (g * 8 + j) * 64), flip);
      for (int c = 0; c < MR; ++c) isum[c] = _mm512_dpbusd_epi32(isum[c], v, bcast4(a.qx + (m0 + c) * a.K + g * G + 4 * j));
    }
    for (int c = 0; c < MR; ++c) {
      const int64_t i = (m0 + c) * ng + g;
      const __m512i exact = _mm512_sub_epi32(isum[c], _mm512_set1_epi32(128 * a.xs[i]));
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a.dx[i]), acc[c]);
    }
  }
  const int64_t n0 = p * PR, valid = std::min(PR, a.N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 s = bf16x16(a.s8 + n0);
  for (int c = 0; c < MR; ++c) _mm512_mask_storeu_ps(a.y + (m0 + c) * a.N + n0, keep, _mm512_mul_ps(acc[c], s));
}
#elif defined(KVQ_AVX2)
template <int MR>
void half_q8(const Args& a, int64_t p, int h, int64_t m0, bool pf) {
  const int64_t n0 = p * PR + h * 8, valid = std::min<int64_t>(8, a.N - n0);
  if (valid <= 0) return;
  const int64_t ng = a.K / G;
  const int8_t* w = panel8(a, p) + h * 32;
  __m256 acc[MR];
  for (int c = 0; c < MR; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_q8(a, p + 1, g);
    __m256i isum[MR];
    for (int c = 0; c < MR; ++c) isum[c] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 8 + j) * 64));
      for (int c = 0; c < MR; ++c) {
        const int64_t at = (m0 + c) * a.K + g * G + 4 * j;
        const __m256i x = bcast4(a.qx + at);
        isum[c] = _mm256_add_epi32(isum[c], dot4(bcast4(a.ax + at), _mm256_sign_epi8(v, x)));
      }
    }
    for (int c = 0; c < MR; ++c) {
      const int64_t i = (m0 + c) * ng + g;
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_set1_ps(a.dx[i]), acc[c]);
    }
  }
  const __m256 s = bf16x8(a.s8 + n0);
  for (int c = 0; c < MR; ++c) store8(a.y + (m0 + c) * a.N + n0, _mm256_mul_ps(acc[c], s), valid);
}

// One row (a decode GEMV), both halves per pass: each 64-byte line is used whole as it arrives
// rather than half now and half on a second pass. Per output the same steps as half_q8, so the
// same bits. The vocabulary-wide int8 lm_head streamed in 0.93-0.96x the time (27 MiB from
// memory, 2 threads, AVX2 Zen 3); the int4 panels gained nothing from the same change.
inline void full_q8_row(const Args& a, int64_t p, int64_t m0, bool pf) {
  const int64_t ng = a.K / G;
  const int8_t* w = panel8(a, p);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_q8(a, p + 1, g);
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 8; ++j) {
      const __m256i x = bcast4(a.qx + m0 * a.K + g * G + 4 * j), ax = _mm256_sign_epi8(x, x);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 8 + j) * 64 + h * 32));
        isum[h] = _mm256_add_epi32(isum[h], dot4(ax, _mm256_sign_epi8(v, x)));
      }
    }
    for (int h = 0; h < 2; ++h)
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_set1_ps(a.dx[m0 * ng + g]), acc[h]);
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t n0 = p * PR + h * 8, valid = std::min<int64_t>(8, a.N - n0);
    if (valid > 0) store8(a.y + m0 * a.N + n0, _mm256_mul_ps(acc[h], bf16x8(a.s8 + n0)), valid);
  }
}

template <int MR>
void panel_q8(const Args& a, int64_t p, int64_t m0, bool pf) {
  if constexpr (MR == 1) {
    full_q8_row(a, p, m0, pf);
  } else {
    half_q8<MR>(a, p, 0, m0, pf);
    half_q8<MR>(a, p, 1, m0, false);
  }
}
#else
template <int MR>
void panel_q8(const Args& a, int64_t p, int64_t m0, bool) {
  const int64_t ng = a.K / G, n0 = p * PR, valid = std::min(PR, a.N - n0);
  const int8_t* w = panel8(a, p);
  for (int c = 0; c < MR; ++c)
    for (int64_t r = 0; r < valid; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        const int8_t* xq = a.qx + (m0 + c) * a.K + g * G;
        int32_t isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 4; ++i) isum += w[(g * 8 + j) * 64 + r * 4 + i] * xq[4 * j + i];
        acc += static_cast<float>(isum) * a.dx[(m0 + c) * ng + g];
      }
      a.y[(m0 + c) * a.N + n0 + r] = acc * bf16(a.s8[n0 + r]);
    }
}
#endif

// ---- AMX: 16 activation rows x one panel per tile multiply -------------------------------
// Where the CPU has AMX-INT8 (the avx512_amx variant), a full tile of 16 activation rows takes
// one group's 16 x 16 x 32 integer products in one tile instruction: A = the rows' int8 codes
// (straight from the quantized activations, stride K), B = the panel's group in VNNI layout (an
// int8 panel's group is already that, 8 chunks of 64 bytes; an int4 one is unpacked to it).
// The int32 sums are the same integers the VNNI loop makes, and the float steps per output
// below are that loop's, so the result is bit-identical to it; fewer rows use the VNNI tiles.
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__)
#include <sys/syscall.h>
#include <unistd.h>

constexpr int AMX_MR = 16;


// Linux hands out the tile registers only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA); once
// per process. False where the kernel refuses: the VNNI tiles then do all the work.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Tiles 0-3: C, 16 x 16 int32 each (up to four groups in flight); 4-5: A, 16 rows x 32 bytes;
// 6-7: B, 8 rows x 64 bytes. One group per tile multiply leaves the tile unit mostly waiting on
// each result's store (perf: ~45% of the kernel on the store and the next A load at 64 rows),
// so up to four independent groups are multiplied before their sums are stored.
// Loaded at every kernel call and released after it: other AMX users on the same thread
// (oneDNN's bf16 matmuls) release the tiles when they finish, and a tile instruction under a
// released configuration is an illegal instruction.
constexpr int AMX_GROUPS = 4;

void amx_configure() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  auto tile = [&](int t, int rows, int colsb) {
    cfg[16 + 2 * t] = static_cast<uint8_t>(colsb);
    cfg[48 + t] = static_cast<uint8_t>(rows);
  };
  for (int t = 0; t < 4; ++t) tile(t, 16, 64);
  tile(4, 16, 32);
  tile(5, 16, 32);
  tile(6, 8, 64);
  tile(7, 8, 64);
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so the stores above could be
  // dropped as dead (benchmarks/bench_amx_ceiling.py's loops, the same code: ldtilecfg on zeros,
  // then SIGILL at the first tile load); this keeps them.
  __asm__ volatile("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

// Group g of int4 panel p as a VNNI-layout B tile: row 2j holds chunk j's low nibbles (inputs
// 8j .. 8j + 3), row 2j + 1 its high ones (8j + 4 .. 8j + 7).
inline void unpack_b_i4(const Args& a, int64_t p, int64_t g, uint8_t* bt) {
  const uint8_t* w = a.w + p * panel_code_bytes(a) + g * 256;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(w + j * 64);
    _mm512_storeu_si512(bt + 128 * j, _mm512_and_si512(v, mask));
    _mm512_storeu_si512(bt + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// Tile numbers are immediates, so each of the four slots is spelled out.
#define KVQ_AMX_SLOT(C, A, B)                                   \
  _tile_zero(C);                                                \
  _tile_loadd(A, x + (C) * G, a.K);                             \
  _tile_loadd(B, b + (C) * 512, 64);                            \
  if constexpr (B_UNSIGNED) _tile_dpbsud(C, A, B);              \
  else _tile_dpbssd(C, A, B);

// Groups g .. g + NB - 1 (NB <= 4) of activation rows [m0, m0 + 16): their 16 x 16 integer sums
// into c[NB][16 x 16] (row-major, 16 int32 per activation row). b: group g's B tile, the next
// groups' following it 512 bytes apart.
template <int NB, bool B_UNSIGNED>
inline void amx_groups(const Args& a, int64_t m0, int64_t g, const uint8_t* b, int32_t* c) {
  const int8_t* x = a.qx + m0 * a.K + g * G;
  KVQ_AMX_SLOT(0, 4, 6)
  if constexpr (NB > 1) { KVQ_AMX_SLOT(1, 5, 7) }
  if constexpr (NB > 2) { KVQ_AMX_SLOT(2, 4, 6) }
  if constexpr (NB > 3) { KVQ_AMX_SLOT(3, 5, 7) }
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NB > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NB > 3) _tile_stored(3, c + 768, 64);
}
#undef KVQ_AMX_SLOT

template <bool B_UNSIGNED>
inline void amx_batch(const Args& a, int64_t m0, int64_t g, int nb, const uint8_t* b, int32_t* c) {
  switch (nb) {
    case 4: return amx_groups<4, B_UNSIGNED>(a, m0, g, b, c);
    case 3: return amx_groups<3, B_UNSIGNED>(a, m0, g, b, c);
    case 2: return amx_groups<2, B_UNSIGNED>(a, m0, g, b, c);
    default: return amx_groups<1, B_UNSIGNED>(a, m0, g, b, c);
  }
}

// Every AMX_MR-row tile of rows [0, M) x int4 panel p: the panel is unpacked to B tiles once,
// then read by each row tile (the B tile written just before its load would stall on it).
void amx_panel_i4(const Args& a, int64_t p, int64_t M, bool pf) {
  const int64_t ng = a.K / G;
  const uint16_t* sz = a.sz + p * panel_sz_elems(a);
  static thread_local std::vector<uint8_t> buffer;
  uint8_t* const bt = line_aligned(buffer, ng * 512);
  for (int64_t g = 0; g < ng; ++g) {
    if (pf) prefetch_group_i4(a, p + 1, g);
    unpack_b_i4(a, p, g, bt + g * 512);
  }
  alignas(64) int32_t c[AMX_GROUPS * AMX_MR * 16];
  for (int64_t m0 = 0; m0 + AMX_MR <= M; m0 += AMX_MR) {
    __m512 acc[AMX_MR], bias[AMX_MR];
    for (int r = 0; r < AMX_MR; ++r) acc[r] = bias[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += AMX_GROUPS) {
      const int nb = static_cast<int>(std::min<int64_t>(AMX_GROUPS, ng - g0));
      amx_batch<true>(a, m0, g0, nb, bt + g0 * 512, c);
      for (int k = 0; k < nb; ++k) {
        const int64_t g = g0 + k;
        const __m512 sw = bf16x16(sz + g * 2 * PR), zw = bf16x16(sz + g * 2 * PR + PR);
        const __m512 mw = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sw, zw);
        for (int r = 0; r < AMX_MR; ++r) {
          const int64_t i = (m0 + r) * ng + g;
          const __m512i isum = _mm512_load_si512(c + 256 * k + 16 * r);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sw, _mm512_set1_ps(a.dx[i])), acc[r]);
          bias[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sx[i]), bias[r]);
        }
      }
    }
    const int64_t n0 = p * PR, valid = std::min(PR, a.N - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < AMX_MR; ++r)
      _mm512_mask_storeu_ps(a.y + (m0 + r) * a.N + n0, keep, _mm512_add_ps(acc[r], bias[r]));
  }
}

// Rows [m0, m0 + AMX_MR) of int8 panel p from their accumulated sums: times the rows' scales,
// the padding outputs of a last partial panel left out.
inline void store_q8_rows(const Args& a, int64_t p, int64_t m0, const __m512* acc) {
  const int64_t n0 = p * PR, valid = std::min(PR, a.N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 s = bf16x16(a.s8 + n0);
  for (int r = 0; r < AMX_MR; ++r) _mm512_mask_storeu_ps(a.y + (m0 + r) * a.N + n0, keep, _mm512_mul_ps(acc[r], s));
}

// Every AMX_MR-row tile of rows [m_begin, M) x int8 panel p (its groups are B tiles as they lie).
void amx_panel_q8(const Args& a, int64_t p, int64_t m_begin, int64_t M, bool pf) {
  const int64_t ng = a.K / G;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(panel8(a, p));
  alignas(64) int32_t c[AMX_GROUPS * AMX_MR * 16];
  for (int64_t m0 = m_begin; m0 + AMX_MR <= M; m0 += AMX_MR, pf = false) {
    __m512 acc[AMX_MR];
    for (int r = 0; r < AMX_MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += AMX_GROUPS) {
      const int nb = static_cast<int>(std::min<int64_t>(AMX_GROUPS, ng - g0));
      if (pf)
        for (int k = 0; k < nb; ++k) prefetch_group_q8(a, p + 1, g0 + k);
      amx_batch<false>(a, m0, g0, nb, w + g0 * 512, c);  // signed x signed: the exact sums
      for (int k = 0; k < nb; ++k)
        for (int r = 0; r < AMX_MR; ++r) {
          const int64_t i = (m0 + r) * ng + g0 + k;
          const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * k + 16 * r));
          acc[r] = _mm512_fmadd_ps(isum, _mm512_set1_ps(a.dx[i]), acc[r]);
        }
    }
    store_q8_rows(a, p, m0, acc);
  }
}

// Two AMX_MR-row tiles (m0, m0 + 16) x two int8 panels (p, p + 1), a group at a time: C0/C1 the
// first row tile times each panel, C2/C3 the second's. Each A and B tile loaded feeds two
// multiplies, where amx_panel_q8 loads both for every one: the tile sequence, not the multiplies,
// bounds these kernels (benchmarks/bench_amx_ceiling.py: 1.06-1.24x its int8 ceiling with the
// host's tile unit at full speed, 1.3-1.5x in minutes when it ran at half speed). The
// same float steps per output in the same order: the same bits. `ahead` panels after p + 1
// (0-2) are prefetched.
void amx_block_q8(const Args& a, int64_t p, int64_t m0, int ahead) {
  const int64_t ng = a.K / G;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(panel8(a, p));
  const uint8_t* w1 = reinterpret_cast<const uint8_t*>(panel8(a, p + 1));
  const int8_t* x0 = a.qx + m0 * a.K;
  const int8_t* x1 = x0 + AMX_MR * a.K;
  alignas(64) int32_t c[4 * AMX_MR * 16];
  __m512 acc[4][AMX_MR];
  for (auto& tile : acc)
    for (__m512& v : tile) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    for (int k = 0; k < ahead; ++k) prefetch_group_q8(a, p + 2 + k, g);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, x0 + g * G, a.K);
    _tile_loadd(6, w0 + g * 512, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_loadd(7, w1 + g * 512, 64);
    _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, x1 + g * G, a.K);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < AMX_MR; ++r) {
        const int64_t i = (m0 + (t >> 1) * AMX_MR + r) * ng + g;
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * t + 16 * r));
        acc[t][r] = _mm512_fmadd_ps(isum, _mm512_set1_ps(a.dx[i]), acc[t][r]);
      }
  }
  for (int t = 0; t < 4; ++t) store_q8_rows(a, p + (t & 1), m0 + (t >> 1) * AMX_MR, acc[t]);
}

// Int8 panels p and p + 1 for rows [0, M) (M >= 32) in 2 x 2 blocks; an odd last row tile of
// each panel alone. p_end: the end of the caller's panel range (what may be prefetched).
void amx_pair_q8(const Args& a, int64_t p, int64_t M, int64_t p_end) {
  const int ahead = static_cast<int>(std::min<int64_t>(2, p_end - p - 2));
  int64_t m0 = 0;
  for (; m0 + 2 * AMX_MR <= M; m0 += 2 * AMX_MR) amx_block_q8(a, p, m0, m0 == 0 ? ahead : 0);
  amx_panel_q8(a, p, m0, M, false);
  amx_panel_q8(a, p + 1, m0, M, false);
}
#define KVQ_AMX 1
#endif

// ---- the panel loop both formats share ------------------------------------------------

#if defined(KVQ_AVX2) && !defined(__AVX512VNNI__)
// The rows' |codes| (all within [-127, 127]), made once a call: half_q8 took them with a
// vpsignb of its own for every row, chunk and panel half, one of its five vector
// instructions per 32 products.
inline Args with_abs_codes(const Args& a, int64_t M) {
  static thread_local std::vector<int8_t> buf;
  const int64_t n = M * a.K;  // K is a multiple of 32
  int8_t* out = line_aligned(buf, n);
  for (int64_t i = 0; i < n; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qx + i));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + i), _mm256_abs_epi8(v));
  }
  Args b = a;
  b.ax = out;
  return b;
}
#endif

struct Int4 {
  static Args rows(const Args& a, int64_t) { return a; }
#if defined(KVQ_UNPACKED_I4)
  static int64_t unpacked_min_rows() { return unpacked_min_rows_i4; }
  static void unpacked(const Args& a, int64_t p, int64_t m, int64_t M) { unpacked_rows_i4(a, p, m, M); }
#else
  static int64_t unpacked_min_rows() { return 0; }
  static void unpacked(const Args&, int64_t, int64_t, int64_t) {}
#endif
  // The calls that ask for the next panel: batched ones in the VNNI (and AMX) builds. With the
  // prefetch, 64 rows of a step's int4 projections took 0.96-0.97x the time there but
  // 1.00-1.02x in the AVX2 build, and a single-stream decode 1.02-1.045x (Zen 4, 2 threads;
  // docs/BENCHMARKS.md issue 16 round 28). The int8 lm_head's one-row stream gains (rounds 9-10).
#if defined(__AVX512VNNI__)
  static constexpr int64_t prefetch_min_rows = 2;
#else
  static constexpr int64_t prefetch_min_rows = std::numeric_limits<int64_t>::max();
#endif
  template <int MR>
  static void tile(const Args& a, int64_t p, int64_t m0, bool pf) { panel_i4<MR>(a, p, m0, pf); }
#if defined(KVQ_AMX)
  static constexpr int64_t amx_min_rows = 32;  // at 16 the per-group float steps outweigh the gain
  static void amx(const Args& a, int64_t p, int64_t M, bool pf) { amx_panel_i4(a, p, M, pf); }
  // No 2 x 2 blocks: with its zero terms their 128 accumulators spill, and the tile loads they
  // save bought 0.86-1.14x (benchmarks/bench_amx_ceiling.py and an ad hoc 2 x 1 variant).
  static constexpr int64_t amx_pair_min_rows = 0;
#endif
  static const void* panel(const Args& a, int64_t p) { return a.w + p * panel_code_bytes(a); }
  static int64_t panel_bytes(const Args& a) { return panel_code_bytes(a); }
};

struct Int8 {
  // What the tiles read besides Args' pointers: the AVX2 ones, the rows' |codes|.
  static Args rows(const Args& a, int64_t M) {
#if defined(KVQ_AVX2) && !defined(__AVX512VNNI__)
    if (M > 1) return with_abs_codes(a, M);
#endif
    (void)M;
    return a;
  }
  static int64_t unpacked_min_rows() { return 0; }  // no unpacked form
  static void unpacked(const Args&, int64_t, int64_t, int64_t) {}
  static constexpr int64_t prefetch_min_rows = 1;
  template <int MR>
  static void tile(const Args& a, int64_t p, int64_t m0, bool pf) { panel_q8<MR>(a, p, m0, pf); }
#if defined(KVQ_AMX)
  static constexpr int64_t amx_min_rows = AMX_MR;
  static void amx(const Args& a, int64_t p, int64_t M, bool pf) { amx_panel_q8(a, p, 0, M, pf); }
  static constexpr int64_t amx_pair_min_rows = 2 * AMX_MR;
  static void amx_pair(const Args& a, int64_t p, int64_t M, int64_t p_end) { amx_pair_q8(a, p, M, p_end); }
#endif
  static const void* panel(const Args& a, int64_t p) { return panel8(a, p); }
  static int64_t panel_bytes(const Args& a) { return a.K * PR; }
};

// The last rows (fewer than TILE_MR) of panel p as one tile of exactly that many.
template <class F, int MR>
void tail(const Args& a, int64_t p, int64_t m0, int64_t rows, bool pf) {
  if constexpr (MR > 0) {
    if (rows == MR) return F::template tile<MR>(a, p, m0, pf);
    tail<F, MR - 1>(a, p, m0, rows, pf);
  }
}

// Rows [m, M) of panel p in the SIMD tiles (TILE_MR rows, then the rest as one tile).
template <class F>
void vector_rows(const Args& a, int64_t p, int64_t m, int64_t M, bool pf) {
  const int64_t unpacked_min = F::unpacked_min_rows();
  if (unpacked_min > 0 && M - m >= unpacked_min) return F::unpacked(a, p, m, M);
  for (; m + TILE_MR <= M; m += TILE_MR, pf = false) F::template tile<TILE_MR>(a, p, m, pf);
  if (m < M) tail<F, TILE_MR - 1>(a, p, m, M - m, pf);
}

// Panels [p0, p1) for all M activation rows; the next panel is prefetched as the current
// panel's first tile runs, and the range's first bytes before it starts.
template <class F>
void panels(const Args& args, int64_t M, int64_t p0, int64_t p1) {
  const Args a = F::rows(args, M);
  prefetch_span(F::panel(a, p0), std::min<int64_t>(PF_BYTES, F::panel_bytes(a)));
#if defined(KVQ_AMX)
  const bool amx = M >= F::amx_min_rows && amx_permitted();
  if (amx) amx_configure();
#endif
  for (int64_t p = p0; p < p1; ++p) {
    bool pf = p + 1 < p1 && M >= F::prefetch_min_rows;
    int64_t m = 0;
#if defined(KVQ_AMX)
    if (amx) {
      m = M / AMX_MR * AMX_MR;
      if constexpr (F::amx_pair_min_rows > 0) {
        if (M >= F::amx_pair_min_rows && p + 1 < p1) {  // this panel and the next, in 2 x 2 blocks
          F::amx_pair(a, p, M, p1);
          vector_rows<F>(a, p, m, M, false);
          vector_rows<F>(a, ++p, m, M, false);
          continue;
        }
      }
      F::amx(a, p, M, pf);
      pf = false;
    }
#endif
    vector_rows<F>(a, p, m, M, pf);
  }
#if defined(KVQ_AMX)
  if (amx) _tile_release();
#endif
}

// ---- entry points ------------------------------------------------------------------------

// Whether int4 tiles of 4+ rows read their codes unpacked once per panel half (the AVX2
// variant's choice; the others have no such form). Returns whether they now do.
bool set_int4_unpacked(bool on) {
#if defined(KVQ_UNPACKED_I4)
  unpacked_min_rows_i4 = on ? UNPACKED_MR : 0;
  return on;
#else
  (void)on;
  return false;
#endif
}

// Every row of x quantized per group of 32 (the activations both kernels multiply), in buffers
// each calling thread keeps: a decode step calls the kernels ~120 times, so no allocation each.
// They only grow: a layer's projections alternate between K = hidden and K = intermediate, and
// resizing to each call's size zero-filled the grown part every time (a memset at ~0.8% of a
// 64-row step's samples). Each call writes every element it reads.
struct QuantizedRows {
  std::vector<int8_t> q;
  int8_t* codes = nullptr;  // q's first cache line: the AMX tiles' rows
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  void fill(const at::Tensor& x) {
    const int64_t M = x.size(0), K = x.size(1), ng = K / G;
    codes = line_aligned(q, M * K);
    if (static_cast<int64_t>(d.size()) < M * ng) d.resize(M * ng), s.resize(M * ng), sum.resize(M * ng);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        quantize_row(xp + m * K, K, codes + m * K, d.data() + m * ng, s.data() + m * ng, sum.data() + m * ng);
    });
  }
};

const QuantizedRows& quantized_rows(const at::Tensor& x) {
  static thread_local QuantizedRows rows;
  rows.fill(x);
  return rows;
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) % G == 0, "K must be a multiple of 32, got ", x.size(1));
}

void check_panels(int64_t N, int64_t P) {
  TORCH_CHECK(N > (P - 1) * PR && N <= P * PR, "N must fill the last of the ", P, " panels of 16 rows, got ", N);
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz, int64_t N) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 64 &&
              codes.size(1) * 8 == K, "codes: uint8 panels [P, K/8, 64] matching K");
  check_panels(N, P);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == P * (K / G) * 2 * PR,
              "sz: contiguous bfloat16 [P, K/32, 2, 16]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows& xq = quantized_rows(x);
  Args a{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>()), N, K,
         xq.codes, xq.d.data(), xq.s.data(), xq.sum.data(), y.data_ptr<float>()};
  // Work unit: one panel; a thread's panels are contiguous.
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) { panels<Int4>(a, M, b, e); });
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(2) == 64 &&
              codes.size(1) * 4 == K, "codes: int8 panels [P, K/4, 64] matching K");
  check_panels(N, P);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == P * PR,
              "scales: bfloat16 [P * 16]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedRows& xq = quantized_rows(x);
  Args a{nullptr, nullptr, N, K, xq.codes, xq.d.data(), xq.s.data(), xq.sum.data(), y.data_ptr<float>(),
         codes.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>())};
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) { panels<Int8>(a, M, b, e); });
  return y;
}

// Rows `ids` of an int8 table in int8_mm's layout as float32 [len(ids), K]: code x the row's
// bf16 scale, the one product QuantizedLinear.embedding's torch ops make, in one call (a tied
// table's lookup each decode step; as torch ops it was ~8 small dispatches).
at::Tensor int8_embedding(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(2) == 64,
              "codes: int8 panels [P, K/4, 64]");
  const int64_t P = codes.size(0), K4 = codes.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == P * PR,
              "scales: bfloat16 [P * 16]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 [n]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.numel(), *id = idc.data_ptr<int64_t>();
  at::Tensor out = at::empty({n, K4 * 4}, codes.options().dtype(at::kFloat));
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < n; ++m) {
    const int64_t r = id[m];
    TORCH_CHECK(r >= 0 && r < P * PR, "embedding: token id ", r, " out of range [0, ", P * PR, ")");
    const int8_t* row = c + (r / PR) * K4 * 64 + (r % PR) * 4;  // chunk j holds inputs 4j .. 4j + 3
    const float scale = bf16(sc[r]);
    for (int64_t j = 0; j < K4; ++j)
      for (int i = 0; i < 4; ++i) o[m * K4 * 4 + 4 * j + i] = static_cast<float>(row[j * 64 + i]) * scale;
  }
  return out;
}

// ---- one thread's share, for a caller that runs its own parallel region ------------------
// cpu_kernels' DecodeStack runs a small decode step's layers inside one parallel region and
// splits each projection's panels between its threads itself (decode_overlap_cpu.cpp): these
// take rows the caller quantized and one panel range, and start no threads. Same arithmetic
// as int4_mm / int8_mm, so the same bits.

void quantize_rows_into(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s, int32_t* sum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, q + m * K, d + m * ng, s + m * ng, sum + m * ng);
}

void int4_panel_range(const void* codes, const void* scales, int64_t N, int64_t K, const int8_t* q, const float* d,
                      const float* s, const int32_t* sum, float* y, int64_t M, int64_t p0, int64_t p1) {
  Args a{static_cast<const uint8_t*>(codes), static_cast<const uint16_t*>(scales), N, K, q, d, s, sum, y};
  if (p0 < p1) panels<Int4>(a, M, p0, p1);
}

void int8_panel_range(const void* codes, const void* scales, int64_t N, int64_t K, const int8_t* q, const float* d,
                      const float* s, const int32_t* sum, float* y, int64_t M, int64_t p0, int64_t p1) {
  Args a{nullptr, nullptr, N, K, q, d, s, sum, y, static_cast<const int8_t*>(codes), static_cast<const uint16_t*>(scales)};
  if (p0 < p1) panels<Int8>(a, M, p0, p1);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "y = x @ W.T for N output rows, W int4 in kvserve's panel layout, int8 activations");
  m.def("int8_mm", &int8_mm, "y = x @ W.T for N output rows, W int8 (a scale per row) in panels, int8 activations");
  m.def("int8_embedding", &int8_embedding, "rows ids of an int8 table in int8_mm's layout, dequantized to float32");
  m.def("isa", &isa_name, "the instruction set this variant was compiled for");
  m.def("set_int4_unpacked", &set_int4_unpacked, "AVX2: int4 tiles of 4+ rows read codes unpacked once per panel half");
  // For cpu_kernels' DecodeStack, which calls the matmuls without Python in between.
  m.def("matmul_addresses", [] {
    return std::map<std::string, int64_t>{{"int4", reinterpret_cast<int64_t>(&int4_mm)},
                                          {"int8", reinterpret_cast<int64_t>(&int8_mm)},
                                          {"int4_panels", reinterpret_cast<int64_t>(&int4_panel_range)},
                                          {"int8_panels", reinterpret_cast<int64_t>(&int8_panel_range)},
                                          {"quantize_rows", reinterpret_cast<int64_t>(&quantize_rows_into)}};
  }, "addresses of int4_mm and int8_mm (at::Tensor (*)(x, codes, scales, N)), of their panel-range forms "
     "and of the activation quantizer they share (decode_stack.h's PanelsFn, QuantizeFn)");
}
