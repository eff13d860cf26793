// The small per-layer operations of a decoder layer, fused, on the CPU (float32 or bfloat16).
//
// At one decoding row a layer's matmuls take a few hundred microseconds, and the ~20 ATen
// calls around them (RMSNorm's pow/mean/rsqrt/mul, rotary's slices/cat/neg/mul, the KV write's
// index_put, SiLU and the gate multiply) cost about as much again: each is a dispatch, an
// allocation and a pass over a few KB. Here each is one call and one pass, as vLLM's CPU build
// does with its rms_norm / rotary_embedding / reshape_and_cache / silu_and_mul ops. Rows are
// independent and each row's arithmetic is the same at every batch size, so batching never
// changes a row's result. Work is split over rows only when there are enough of them.
// bfloat16 tensors (a `--dtype bfloat16` model) are widened to float32 as they are read, each
// op computes in float32 and its result is rounded to bfloat16 once, as it is stored (vLLM's
// CPU ops do the same); the torch path rounds after every ATen op instead.
#include "cpu_kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowGrain = 16;  // rows per parallel chunk: below this, one thread

inline float ld(const float* p) { return *p; }
inline float ld(const at::BFloat16* p) { return static_cast<float>(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // round to nearest even

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with contiguous rows");
}

void check_same(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the activations' dtype");
}

// out = x * rsqrt(mean(x^2) + eps) * w, one row (the reference's order of operations).
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += ld(x + i) * ld(x + i);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) st(out + i, (ld(x + i) * r) * ld(w + i));
}

// Rows [0, rows) of the ops below (row r of x at x + r * sx, of out at out + r * d): the loops
// every form shares, the tensors' on either dtype and raw:: on float32 buffers.
template <typename T>
inline void add_rms_norm_rows(T* x, int64_t sx, const T* delta, int64_t sd, const T* w, T* out, int64_t rows,
                              int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * sx;
    if (delta != nullptr) {
      const T* dr = delta + r * sd;
      for (int64_t i = 0; i < d; ++i) st(xr + i, ld(xr + i) + ld(dr + i));  // the stream, rounded
    }
    rms_norm_row(xr, w, out + r * d, d, eps);
  }
}

template <typename T>
inline void rotary_rows(T* x, int64_t rows, int64_t heads, int64_t hd, int64_t sr, int64_t sh, const T* cp,
                        const T* sp) {
  const int64_t half = hd / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T *c = cp + r * hd, *s = sp + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * sr + h * sh;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = ld(v + i), x2 = ld(v + i + half);
        st(v + i, x1 * ld(c + i) - x2 * ld(s + i));
        st(v + i + half, x2 * ld(c + i + half) + x1 * ld(s + i + half));
      }
    }
  }
}

template <typename T>
inline void silu_mul_rows(const T* gate_up, int64_t sg, T* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const T *g = gate_up + r * sg, *u = g + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gi = ld(g + i);
      st(o + i, gi / (1.f + std::exp(-gi)) * ld(u + i));
    }
  }
}

// Runs fn.template operator()<T>() with T the C++ type of a float32 / bfloat16 tensor.
template <typename Fn>
void dispatch(const torch::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == torch::kBFloat16) fn(at::BFloat16{});
  else fn(float{});
}

}  // namespace

// Not inlined: the tensors' float32 forms call these very functions, so both take the same
// compiled loops (-ffast-math leaves the compiler free to vectorize each copy its own way).
namespace raw {
__attribute__((noinline)) void add_rms_norm(float* x, int64_t sx, const float* delta, int64_t sd, const float* w,
                                            float* out, int64_t rows, int64_t d, float eps) {
  add_rms_norm_rows(x, sx, delta, sd, w, out, rows, d, eps);
}

__attribute__((noinline)) void rotary(float* x, int64_t rows, int64_t heads, int64_t hd, int64_t sr, int64_t sh,
                                      const float* cos, const float* sin) {
  rotary_rows(x, rows, heads, hd, sr, sh, cos, sin);
}

__attribute__((noinline)) void silu_mul(const float* gate_up, int64_t sg, float* out, int64_t rows, int64_t inter) {
  silu_mul_rows(gate_up, sg, out, rows, inter);
}
}  // namespace raw

namespace {
// The float32 forms through raw::, the bfloat16 ones through the templates.
inline void add_rms_norm_any(float* x, int64_t sx, const float* delta, int64_t sd, const float* w, float* out,
                             int64_t rows, int64_t d, float eps) {
  raw::add_rms_norm(x, sx, delta, sd, w, out, rows, d, eps);
}
inline void add_rms_norm_any(at::BFloat16* x, int64_t sx, const at::BFloat16* delta, int64_t sd,
                             const at::BFloat16* w, at::BFloat16* out, int64_t rows, int64_t d, float eps) {
  add_rms_norm_rows(x, sx, delta, sd, w, out, rows, d, eps);
}
inline void rotary_any(float* x, int64_t rows, int64_t heads, int64_t hd, int64_t sr, int64_t sh, const float* c,
                       const float* s) {
  raw::rotary(x, rows, heads, hd, sr, sh, c, s);
}
inline void rotary_any(at::BFloat16* x, int64_t rows, int64_t heads, int64_t hd, int64_t sr, int64_t sh,
                       const at::BFloat16* c, const at::BFloat16* s) {
  rotary_rows(x, rows, heads, hd, sr, sh, c, s);
}
inline void silu_mul_any(const float* g, int64_t sg, float* out, int64_t rows, int64_t inter) {
  raw::silu_mul(g, sg, out, rows, inter);
}
inline void silu_mul_any(const at::BFloat16* g, int64_t sg, at::BFloat16* out, int64_t rows, int64_t inter) {
  silu_mul_rows(g, sg, out, rows, inter);
}
}  // namespace

// RMSNorm of each row of x [rows, d] with weight w [d] (same dtype); returns a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_same(w, x, "weight");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "weight must be [d]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t d = x.size(1), sx = x.stride(0);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T *xp = x.data_ptr<T>(), *op = out.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t a, int64_t b) {
      add_rms_norm_any(xp + a * sx, sx, static_cast<const T*>(nullptr), 0, wp, op + a * d, b - a, d,
                       static_cast<float>(eps));
    });
  });
  return out;
}

// x += delta (in place: the residual stream), then returns RMSNorm(x) with weight w.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_same(delta, x, "delta");
  check_same(w, x, "weight");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must have x's shape");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "weight must be [d]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t d = x.size(1), sx = x.stride(0), sd = delta.stride(0);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T *dp = delta.data_ptr<T>(), *wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t a, int64_t b) {
      add_rms_norm_any(xp + a * sx, sx, dp + a * sd, sd, wp, op + a * d, b - a, d, static_cast<float>(eps));
    });
  });
  return out;
}

// Rotary embedding (rotate-half / NeoX form) applied in place to x [rows, heads, head_dim]
// (any row and head strides, contiguous head_dim), with cos/sin [rows, head_dim] already
// gathered for each row's position: x * cos + rotate_half(x) * sin.
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) && x.dim() == 3 &&
                  x.stride(2) == 1,
              "x: float32 or bfloat16 [rows, heads, hd]");
  check_same(cos, x, "cos");
  check_same(sin, x, "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(),
              "cos/sin: contiguous [rows, head_dim]");
  const int64_t heads = x.size(1), hd = x.size(2), sr = x.stride(0), sh = x.stride(1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t a, int64_t b) {
      rotary_any(xp + a * sr, b - a, heads, hd, sr, sh, cp + a * hd, sp + a * hd);
    });
  });
}

namespace {
// Rows [a, b) of kv_write: k and v rows / heads at byte strides, elements of esize bytes.
inline void kv_write_rows(char* kc, char* vc, const char* kp, int64_t sk0, int64_t sk1, const char* vp, int64_t sv0,
                          int64_t sv1, int64_t esize, const raw::KvSlots& slots, int64_t a, int64_t b) {
  const int64_t kvh = slots.kv_heads, bs = slots.block_size, hd = slots.head_dim;
  const int64_t *blk = slots.blk, *off = slots.off;
  // Every destination line asked for (for writing) before the first copy: each row lands in
  // its own cold block, and one miss at a time cost ~36 us for a 64-row decode step.
  for (int64_t t = a; t < b; ++t)
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t dst = ((blk[t] * kvh + h) * bs + off[t]) * hd * esize;
      for (int64_t o = 0; o < hd * esize; o += 64) {
        __builtin_prefetch(kc + dst + o, 1, 3);
        __builtin_prefetch(vc + dst + o, 1, 3);
      }
    }
  for (int64_t t = a; t < b; ++t) {
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t dst = ((blk[t] * kvh + h) * bs + off[t]) * hd * esize;
      std::memcpy(kc + dst, kp + t * sk0 + h * sk1, hd * esize);
      std::memcpy(vc + dst, vp + t * sv0 + h * sv1, hd * esize);
    }
  }
}
}  // namespace

void raw::check_slots(const KvSlots& slots, int64_t blocks) {
  for (int64_t t = 0; t < slots.n; ++t)
    TORCH_CHECK(slots.blk[t] >= 0 && slots.blk[t] < blocks && slots.off[t] >= 0 && slots.off[t] < slots.block_size,
                "slot out of range");
}

void raw::kv_write(float* k_cache, float* v_cache, const float* k, int64_t sk0, int64_t sk1, const float* v,
                   int64_t sv0, int64_t sv1, const KvSlots& slots) {
  constexpr int64_t e = sizeof(float);
  kv_write_rows(reinterpret_cast<char*>(k_cache), reinterpret_cast<char*>(v_cache),
                reinterpret_cast<const char*>(k), sk0 * e, sk1 * e, reinterpret_cast<const char*>(v), sv0 * e,
                sv1 * e, e, slots, 0, slots.n);
}

// Stores the first len(slot_blocks) rows of k and v [rows, kv_heads, head_dim] into the
// caches [blocks, kv_heads, block_size, head_dim] (same dtype) at (block, offset) per row.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_blocks, torch::Tensor slot_offsets) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "k/v must have the cache's dtype");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v: [rows, kv_heads, hd]");
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous(),
              "int64 slot blocks and offsets");
  const int64_t n = slot_blocks.numel(), kvh = k_cache.size(1), bs = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(k.size(0) >= n && v.size(0) >= n && k.size(1) == kvh && k.size(2) == hd, "k/v shape");
  const int64_t esize = k.element_size(), nblocks = k_cache.size(0);
  const raw::KvSlots slots{slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), n, kvh, bs, hd};
  raw::check_slots(slots, nblocks);
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, n, kRowGrain * 4, [&](int64_t a, int64_t b) {
    kv_write_rows(kc, vc, kp, k.stride(0) * esize, k.stride(1) * esize, vp, v.stride(0) * esize,
                  v.stride(1) * esize, esize, slots, a, b);
  });
}

// kv_write for a 1-byte cache: each K and V head vector of the first len(slot_blocks) rows
// becomes codes plus one bfloat16 scale (max|x| / qmax, at least 1e-8; qmax 127 for int8
// codes, 448 for float8_e4m3fn ones), exactly as kv_quant.quantize_kv computes them, stored at
// (block, offset); the scales go to k_scales / v_scales [blocks, kv_heads, block_size]. With
// round_trip, those rows of k and v are replaced by what the cache gives back (codes x scale),
// so a prefill chunk attends to the same values later decodes read. One pass where the torch
// path dispatches ~15 ops a layer.
// Compiled without -ffast-math: its reciprocal division moved a code by one now and then. For
// the same reason nothing here calls an inline helper from outside the pragma (GCC will not
// inline across the changed options, and a call per element cost ~4 us a row: ~10% of a
// 32-sequence step at 2 threads), c10's float8 conversions included: fp8 has its own below.
// float32 head vectors of a multiple of 16 take 16-lane registers where the CPU has AVX-512
// (int8 codes): the same IEEE division and round-half-to-even per element, so the same codes.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
namespace {

// float8_e4m3fn's code for f, |f| <= 448 (clamped before): round to nearest even, subnormals
// too, as c10::Float8_e4m3fn(float) and so torch's .to(float8_e4m3fn) round it
// (tests/test_cpu_layer_ops.py compares the two over every code's neighbourhood).
inline uint8_t fp8_e4m3_code(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t code;
  if (bits < (121u << 23)) {  // below 2^-6: e4m3's subnormals, rounded by a float addition of 2^14
    constexpr uint32_t kDenormBits = 141u << 23;
    float bias, sum;
    std::memcpy(&bias, &kDenormBits, 4);
    std::memcpy(&sum, &bits, 4);
    sum += bias;
    std::memcpy(&bits, &sum, 4);
    code = static_cast<uint8_t>(bits - kDenormBits);
  } else {  // rebias the exponent (127 -> 7), round the 20 dropped mantissa bits half to even
    const uint32_t odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd;
    code = static_cast<uint8_t>(bits >> 20);
  }
  return code | static_cast<uint8_t>(sign >> 24);
}

// The value of a float8_e4m3fn code (not NaN: the writes never make one).
inline float fp8_e4m3_value(uint8_t code) {
  const uint32_t exp = (code >> 3) & 0xFu, mant = code & 7u;
  float m;
  if (exp == 0) {
    m = static_cast<float>(mant) * 0.001953125f;  // mant / 8 * 2^-6, exact
  } else {
    const uint32_t bits = ((exp + 120u) << 23) | (mant << 20);
    std::memcpy(&m, &bits, 4);
  }
  return code & 0x80u ? -m : m;
}

// One head vector x[0, hd) -> codes c and the returned scale; x rewritten as codes x scale
// when round_trip. C: int8_t, or uint8_t for float8_e4m3fn's bits.
template <typename T, typename C>
at::BFloat16 quantize_head(T* x, int64_t hd, C* c, bool round_trip) {
  constexpr bool fp8 = std::is_same_v<C, uint8_t>;
  constexpr float qmax = fp8 ? 448.f : 127.f;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && !fp8) {
    if (hd % 16 == 0) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < hd; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
      const float r = _mm512_reduce_max_ps(amax) / 127.f;
      const at::BFloat16 s(r > 1e-8f ? r : 1e-8f);  // rounded as torch's .to(bfloat16)
      const float sf = static_cast<float>(s);
      const __m512 vs = _mm512_set1_ps(sf), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      for (int64_t i = 0; i < hd; i += 16) {
        const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), lo), hi);
        const __m512 q = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
        if (round_trip) _mm512_storeu_ps(x + i, _mm512_mul_ps(q, vs));
      }
      return s;
    }
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < hd; ++i) {
    const float a = static_cast<float>(x[i]);
    const float m = a < 0.f ? -a : a;
    amax = m > amax ? m : amax;
  }
  const float r = amax / qmax;
  const at::BFloat16 s(r > 1e-8f ? r : 1e-8f);  // rounded as torch's .to(bfloat16)
  const float sf = static_cast<float>(s);
  for (int64_t i = 0; i < hd; ++i) {
    float y = static_cast<float>(x[i]) / sf;
    y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
    float q;
    if constexpr (fp8) {
      c[i] = fp8_e4m3_code(y);
      q = fp8_e4m3_value(c[i]);
    } else {
      q = std::nearbyint(y);  // half to even
      c[i] = static_cast<int8_t>(q);
    }
    if (round_trip) x[i] = static_cast<T>(q * sf);
  }
  return s;
}

// One side (K or V) of kv_write_codes: its head vectors (row and head strides) and the cache's
// codes and scales.
template <typename T, typename C>
struct CodedSide {
  T* x;
  int64_t s0, s1;
  C* codes;
  at::BFloat16* scales;
};

template <typename T, typename C>
void kv_write_codes_rows(const CodedSide<T, C> (&sides)[2], const raw::KvSlots& slots, int64_t a, int64_t b,
                         bool round_trip) {
  const int64_t kvh = slots.kv_heads, bs = slots.block_size, hd = slots.head_dim;
  for (int64_t t = a; t < b; ++t)
    for (const CodedSide<T, C>& side : sides)
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t slot = (slots.blk[t] * kvh + h) * bs + slots.off[t];
        side.scales[slot] = quantize_head(side.x + t * side.s0 + h * side.s1, hd, side.codes + slot * hd, round_trip);
      }
}

// fn(C{}) for the cache's codes: int8_t, or uint8_t for float8_e4m3fn's bits.
template <typename Fn>
void dispatch_codes(bool fp8, Fn&& fn) {
  if (fp8) fn(uint8_t{});
  else fn(int8_t{});
}

}  // namespace

void kv_write_codes(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                    torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                    bool round_trip) {
  const auto kind = k_cache.scalar_type();
  TORCH_CHECK((kind == torch::kChar || kind == torch::kFloat8_e4m3fn) && v_cache.scalar_type() == kind &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous int8 or float8_e4m3fn caches");
  TORCH_CHECK(k_scales.scalar_type() == torch::kBFloat16 && v_scales.scalar_type() == torch::kBFloat16 &&
                  k_scales.is_contiguous() && v_scales.is_contiguous() &&
                  k_scales.numel() * k_cache.size(3) == k_cache.numel() && v_scales.numel() == k_scales.numel(),
              "contiguous bfloat16 scales [blocks, kv_heads, block_size]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16),
              "k/v: float32 or bfloat16");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v: [rows, kv_heads, hd]");
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous(),
              "int64 slot blocks and offsets");
  const int64_t n = slot_blocks.numel(), kvh = k_cache.size(1), bs = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(k.size(0) >= n && v.size(0) >= n && k.size(1) == kvh && k.size(2) == hd && v.sizes() == k.sizes(),
              "k/v shape");
  const int64_t nblocks = k_cache.size(0);
  const raw::KvSlots slots{slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), n, kvh, bs, hd};
  raw::check_slots(slots, nblocks);
  dispatch(k, [&](auto tag) {
    using T = decltype(tag);
    dispatch_codes(kind == torch::kFloat8_e4m3fn, [&](auto code_tag) {
      using C = decltype(code_tag);
      const CodedSide<T, C> sides[2] = {
          {k.data_ptr<T>(), k.stride(0), k.stride(1), static_cast<C*>(k_cache.data_ptr()),
           k_scales.data_ptr<at::BFloat16>()},
          {v.data_ptr<T>(), v.stride(0), v.stride(1), static_cast<C*>(v_cache.data_ptr()),
           v_scales.data_ptr<at::BFloat16>()}};
      at::parallel_for(0, n, kRowGrain * 4,
                       [&](int64_t a, int64_t b) { kv_write_codes_rows(sides, slots, a, b, round_trip); });
    });
  });
}

void raw::kv_write_codes(void* k_cache, void* v_cache, bool fp8, at::BFloat16* k_scales, at::BFloat16* v_scales,
                         float* k, int64_t sk0, int64_t sk1, float* v, int64_t sv0, int64_t sv1, const KvSlots& slots) {
  dispatch_codes(fp8, [&](auto code_tag) {
    using C = decltype(code_tag);
    const CodedSide<float, C> sides[2] = {{k, sk0, sk1, static_cast<C*>(k_cache), k_scales},
                                          {v, sv0, sv1, static_cast<C*>(v_cache), v_scales}};
    kv_write_codes_rows(sides, slots, 0, slots.n, false);
  });
}
#pragma GCC pop_options

// gate_up [rows, 2 * I] (gate | up) -> silu(gate) * up [rows, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2, sg = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t a, int64_t b) {
      silu_mul_any(gp + a * sg, sg, op + a * inter, b - a, inter);
    });
  });
  return out;
}
