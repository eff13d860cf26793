// Paged attention for decode (one query token per sequence) on the CPU.
//
// Reads each sequence's keys and values straight from the block pool through its block
// table: no gathered copy of the KV cache is ever made, so a decode step touches each
// cached K/V row exactly once. One work item per (sequence, kv head); the query heads that
// share that kv head (grouped-query attention) are processed together.
//
// A 1-byte cache (fp8 e4m3 or int8 codes) comes with one bfloat16 scale per token and kv
// head; each block's slice is dequantized into a small float buffer before use, so the
// arithmetic below is the same for every cache type.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// All 256 e4m3 codes as floats: a table lookup beats decoding the bits per element.
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

template <typename C>
constexpr bool is_quantized() {
  return std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, int8_t>;
}

// rows x head_dim codes, one scale per row -> floats.
template <typename C>
void dequantize_rows(const C* codes, const at::BFloat16* scales, int64_t rows, int64_t head_dim, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = static_cast<float>(scales[r]);
    const C* src = codes + r * head_dim;
    float* d = dst + r * head_dim;
    if constexpr (std::is_same_v<C, int8_t>) {
      for (int64_t i = 0; i < head_dim; ++i) d[i] = s * static_cast<float>(src[i]);
    } else {
      const float* table = fp8_table().data();
      const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < head_dim; ++i) d[i] = s * table[bits[i]];
    }
  }
}

// Asks for `bytes` from p into the cache (Locality 3: L1, 2: L2). A sequence's blocks lie
// scattered over the pool, a few KB each, and the hardware prefetchers stop at each one's
// end: without this, a step that reads its KV from memory waits on every block's first lines.
template <int Locality>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, Locality);
}

#if defined(__AVX512F__)
#include <immintrin.h>
// A 1-byte cache's block, once dequantized into floats, against a kv head's query heads with
// the head dimension in 16-lane registers: the generic loops below compile to 8-lane ones with
// an accumulator reloaded every four keys, and at 164 tokens x 32 sequences an int8 cache read
// only a third as fast as its 4x smaller bytes allow (bench_paged_attention.py). A float cache
// keeps the generic loops: it waits on memory either way, and its results stay as they were.
// dequantize_rows for int8 with the head size a constant: through the generic one, this path
// measured 0.205 ms a call instead of 0.172 (bench_paged_attention.py).
template <int HD>
inline void dequantize_int8_rows(const int8_t* codes, const at::BFloat16* scales, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(static_cast<float>(scales[r]));
    for (int c = 0; c < HD / 16; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * HD + 16 * c));
      _mm512_storeu_ps(dst + r * HD + 16 * c, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))));
    }
  }
}

// scores[g * len + o] = q_g . k_o for the block's n keys kb (n x HD floats).
template <int HD>
inline void block_scores(const float* kb, int64_t n, const float* qf, int64_t group, float* srow, int64_t len) {
  constexpr int V = HD / 16;
  for (int64_t g = 0; g < group; ++g) {
    __m512 q[V];
    for (int c = 0; c < V; ++c) q[c] = _mm512_loadu_ps(qf + g * HD + 16 * c);
    for (int64_t o = 0; o < n; ++o) {
      const float* k = kb + o * HD;
      __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
      for (int c = 1; c < V; ++c) dot = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), dot);
      srow[g * len + o] = _mm512_reduce_add_ps(dot);
    }
  }
}

// acc_g += sum_o p_g[o] v_o for the block's n values vb; p: the block's first probability of
// head 0 (head g's at g * len), each head's accumulator in registers for the whole block.
template <int HD>
inline void block_values(const float* vb, int64_t n, const float* p, int64_t group, int64_t len, float* acc) {
  constexpr int V = HD / 16;
  for (int64_t g = 0; g < group; ++g) {
    __m512 a[V];
    for (int c = 0; c < V; ++c) a[c] = _mm512_loadu_ps(acc + g * HD + 16 * c);
    for (int64_t o = 0; o < n; ++o) {
      const __m512 w = _mm512_set1_ps(p[g * len + o]);
      for (int c = 0; c < V; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vb + o * HD + 16 * c), a[c]);
    }
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + g * HD + 16 * c, a[c]);
  }
}
constexpr bool kAvx512 = true;
#else
template <int HD>
inline void dequantize_int8_rows(const int8_t*, const at::BFloat16*, int64_t, float*) {}
template <int HD>
inline void block_scores(const float*, int64_t, const float*, int64_t, float*, int64_t) {}
template <int HD>
inline void block_values(const float*, int64_t, const float*, int64_t, int64_t, float*) {}
constexpr bool kAvx512 = false;
#endif

template <typename T, typename C, int HD>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
                   double scale) {
  // KV element type as the loops read it: the cache's own, or float after dequantizing.
  using K = std::conditional_t<is_quantized<C>(), float, C>;
  // An int8 cache through the 16-lane block loops above (HD a multiple of 16, AVX-512).
  constexpr bool wide = kAvx512 && std::is_same_v<C, int8_t> && HD > 0 && HD % 16 == 0;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = HD > 0 ? HD : q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const at::BFloat16* ksp = is_quantized<C>() ? k_scale.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* vsp = is_quantized<C>() ? v_scale.data_ptr<at::BFloat16>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t block_stride = num_kv_heads * block_size * head_dim;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    std::vector<float> buf(is_quantized<C>() ? block_size * head_dim : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kh = item % num_kv_heads, len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = static_cast<float>(qp[(s * num_heads + kh * group + g) * head_dim + d]) * scale;
      scores.assign(group * len, 0.f);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t slice = table[b] * num_kv_heads * block_size + kh * block_size;  // first row
        const int64_t n = std::min(block_size, len - b * block_size);
        // The next block's keys (or the next item's first ones) to L1, this block's values to L2.
        if (b + 1 < num_blocks) {
          const int64_t next = table[b + 1] * num_kv_heads * block_size + kh * block_size;
          prefetch_bytes<3>(kp + next * head_dim, block_size * head_dim * sizeof(C));
          if constexpr (is_quantized<C>()) prefetch_bytes<3>(ksp + next, block_size * 2);
        } else if (item + 1 < end) {
          const int64_t s2 = (item + 1) / num_kv_heads, kh2 = (item + 1) % num_kv_heads;
          const int64_t next = tables[s2 * max_blocks] * num_kv_heads * block_size + kh2 * block_size;
          prefetch_bytes<3>(kp + next * head_dim, block_size * head_dim * sizeof(C));
        }
        prefetch_bytes<2>(vp + slice * head_dim, n * head_dim * sizeof(C));
        if constexpr (is_quantized<C>()) prefetch_bytes<2>(vsp + slice, n * 2);
        const K* kb;
        if constexpr (wide) {
          dequantize_int8_rows<HD>(kp + slice * head_dim, ksp + slice, n, buf.data());
          block_scores<HD>(buf.data(), n, qf.data(), group, scores.data() + b * block_size, len);
          continue;
        }
        if constexpr (is_quantized<C>()) {
          dequantize_rows(kp + slice * head_dim, ksp + slice, n, head_dim, buf.data());
          kb = buf.data();
        } else {
          kb = kp + table[b] * block_stride + kh * block_size * head_dim;
        }
        float* srow = scores.data() + b * block_size;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          int64_t o = 0;
          // Four keys at a time: independent accumulators keep the FMA units busy.
          for (; o + 4 <= n; o += 4) {
            const K* k0 = kb + o * head_dim;
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) {
              const float x = qg[d];
              d0 += x * static_cast<float>(k0[d]);
              d1 += x * static_cast<float>(k0[head_dim + d]);
              d2 += x * static_cast<float>(k0[2 * head_dim + d]);
              d3 += x * static_cast<float>(k0[3 * head_dim + d]);
            }
            srow[g * len + o] = d0;
            srow[g * len + o + 1] = d1;
            srow[g * len + o + 2] = d2;
            srow[g * len + o + 3] = d3;
          }
          for (; o < n; ++o) {
            const K* kr = kb + o * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(kr[d]);
            srow[g * len + o] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t slice = table[b] * num_kv_heads * block_size + kh * block_size;
        const int64_t n = std::min(block_size, len - b * block_size);
        if constexpr (wide) {
          dequantize_int8_rows<HD>(vp + slice * head_dim, vsp + slice, n, buf.data());
          block_values<HD>(buf.data(), n, scores.data() + b * block_size, group, len, acc.data());
          continue;
        }
        const K* vb;
        if constexpr (is_quantized<C>()) {
          dequantize_rows(vp + slice * head_dim, vsp + slice, n, head_dim, buf.data());
          vb = buf.data();
        } else {
          vb = vp + table[b] * block_stride + kh * block_size * head_dim;
        }
        // Four keys per pass over a head's accumulator: one load and one store of it per four
        // keys rather than per key (benchmarks/bench_paged_attention.py, 32 sequences of 164
        // tokens: int8 cache 0.32 -> 0.26 ms a call, fp32 0.295 -> 0.27-0.28).
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = scores.data() + g * len + b * block_size;
          float* __restrict__ ag = acc.data() + g * head_dim;
          int64_t o = 0;
          for (; o + 4 <= n; o += 4) {
            const K* __restrict__ v0 = vb + o * head_dim;
            const float p0 = pg[o], p1 = pg[o + 1], p2 = pg[o + 2], p3 = pg[o + 3];
            for (int64_t d = 0; d < head_dim; ++d)
              ag[d] += p0 * static_cast<float>(v0[d]) + p1 * static_cast<float>(v0[head_dim + d]) +
                       p2 * static_cast<float>(v0[2 * head_dim + d]) + p3 * static_cast<float>(v0[3 * head_dim + d]);
          }
          for (; o < n; ++o) {
            const K* __restrict__ vr = vb + o * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += pg[o] * static_cast<float>(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          op[(s * num_heads + kh * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

// The kernel with head_dim a compile-time constant where it is a common one (the loops over a
// head then unroll fully), else read at run time.
template <typename T, typename C>
void decode_hd(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& bt,
               const torch::Tensor& sl, torch::Tensor& out, double scale) {
  switch (q.size(2)) {
    case 64: return decode_kernel<T, C, 64>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
    case 128: return decode_kernel<T, C, 128>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
    default: return decode_kernel<T, C, 0>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
  }
}

template <typename T>
void dispatch_cache(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& bt,
                    const torch::Tensor& sl, torch::Tensor& out, double scale) {
  const auto kind = k_cache.scalar_type();
  if (kind == q.scalar_type()) {
    decode_hd<T, T>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
    return;
  }
  TORCH_CHECK(kind == torch::kFloat8_e4m3fn || kind == torch::kChar,
              "paged_decode_attention: the cache must match q's dtype, or be float8_e4m3fn / int8");
  TORCH_CHECK(k_scale.scalar_type() == torch::kBFloat16 && v_scale.is_contiguous() && k_scale.is_contiguous() &&
                  k_scale.numel() * k_cache.size(3) == k_cache.numel() && v_scale.numel() == k_scale.numel(),
              "a 1-byte cache needs contiguous bfloat16 scales [blocks, kv_heads, block_size]");
  if (kind == torch::kChar)
    decode_hd<T, int8_t>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
  else
    decode_hd<T, c10::Float8_e4m3fn>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
}

}  // namespace

// q: [seqs, heads, head_dim]; k_cache/v_cache: [blocks, kv_heads, block_size, head_dim] of q's
// dtype, or of float8_e4m3fn / int8 with k_scale/v_scale [blocks, kv_heads, block_size] bfloat16
// (empty tensors otherwise); block_tables: [seqs, max_blocks] int64; seq_lens: [seqs] int64.
// Returns [seqs, heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "int64 block tables and lengths");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat) {
    dispatch_cache<float>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    dispatch_cache<at::BFloat16>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}
