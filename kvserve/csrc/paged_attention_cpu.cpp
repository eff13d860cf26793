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
#include "cpu_kernels.h"

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
// An int8 cache's block against a kv head's query heads, with the head dimension in 16-lane
// registers: the generic loops compile to 8-lane ones with an accumulator reloaded every four
// keys, and at 164 tokens x 32 sequences an int8 cache read only a third as fast as its 4x
// smaller bytes allow. Each key's and value's scale is applied once, to its dot product or its
// weight, rather than to each code, and 16 keys' dot products are summed across lanes together:
// 5-10% faster than dequantizing each block and summing one key at a time
// (bench_paged_attention.py; it still reads only about half as many bytes a second as a float32
// cache). A float cache keeps the generic loops: it waits on memory either way, and its
// results stay as they were.

// 16 int8 codes -> floats, unscaled.
inline __m512 widen16(const int8_t* codes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
}

// Lane o of the result: the sum of v[o]'s 16 lanes. Pairs, then quads, of vectors are folded
// into each other's lanes (45 shuffles and adds for 16 sums, where one sum at a time takes 8).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 quad[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 *a = v + 4 * i, *b = a + 2;
    // In every 128-bit lane: pairwise sums of v0's and v1's elements interleaved (s01), then
    // each of the four vectors' sum over that lane, in order.
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  }
  // quad[i]'s 128-bit lane j holds vectors 4i..4i+3's sums over their lane j: add the four
  // 128-bit lanes of each quad, landing quad i in 128-bit lane i.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44), _mm512_shuffle_f32x4(quad[0], quad[1], 0xEE));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44), _mm512_shuffle_f32x4(quad[2], quad[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Up to 16 bfloat16 scales as floats (zero past n).
inline __m512 scales16(const at::BFloat16* s, int64_t n) {
  alignas(64) float f[16] = {};
  for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(s[i]);
  return _mm512_load_ps(f);
}

// scores[g * len + o] = (q_g . codes_o) * scale_o for the block's n keys kb (n x HD floats,
// the codes widened), 16 keys at a time.
template <int HD>
inline void block_scores(const float* kb, const at::BFloat16* ks, int64_t n, const float* qf, int64_t group,
                         float* srow, int64_t len) {
  constexpr int V = HD / 16;
  for (int64_t o0 = 0; o0 < n; o0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - o0);
    const __m512 sc = scales16(ks + o0, m);
    const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
    for (int64_t g = 0; g < group; ++g) {
      __m512 q[V], dot[16];
      for (int c = 0; c < V; ++c) q[c] = _mm512_loadu_ps(qf + g * HD + 16 * c);
      for (int o = 0; o < 16; ++o) {
        dot[o] = _mm512_setzero_ps();
        if (o < m) {
          const float* k = kb + (o0 + o) * HD;
          for (int c = 0; c < V; ++c) dot[o] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), dot[o]);
        }
      }
      _mm512_mask_storeu_ps(srow + g * len + o0, keep, _mm512_mul_ps(sum_lanes16(dot), sc));
    }
  }
}

constexpr int kMaxWideGroup = 4;  // block_values keeps this many heads' accumulators in registers

// block_scores for an int8 cache's keys (codes kb), each key widened in registers and dotted
// with every head of the group, rather than the block widened into a buffer first and read
// back: the same products in the same order, so the same bits (with the split by work below,
// 0.93-0.96x the kernel's time at 32 x 164 tokens: bench_paged_attention.py; docs/BENCHMARKS.md
// issue 16 round 25).
template <int HD>
inline void int8_block_scores(const int8_t* kb, const at::BFloat16* ks, int64_t n, const float* qf, int64_t group,
                              float* srow, int64_t len, float* /*widened: unused*/) {
  constexpr int V = HD / 16;
  alignas(64) float dots[kMaxWideGroup][16][16];
  for (int64_t o0 = 0; o0 < n; o0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - o0);
    for (int64_t o = 0; o < m; ++o) {
      __m512 k[V];
      for (int c = 0; c < V; ++c) k[c] = widen16(kb + (o0 + o) * HD + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < V; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * HD + 16 * c), k[c], dot);
        _mm512_store_ps(dots[g][o], dot);
      }
    }
    const __m512 sc = scales16(ks + o0, m);
    const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot[16];
      for (int o = 0; o < 16; ++o) dot[o] = o < m ? _mm512_load_ps(dots[g][o]) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(srow + g * len + o0, keep, _mm512_mul_ps(sum_lanes16(dot), sc));
    }
  }
}

// acc_g += sum_o (p_g[o] * scale_o) codes_o for the block's n values (int8 codes vb); p: the
// block's first probability of head 0 (head g's at g * len). Each value row is widened once
// and added into every head's accumulator, all of them in registers (group <= 4).
template <int HD>
inline void block_values(const int8_t* vb, const at::BFloat16* vs, int64_t n, const float* p, int64_t group,
                         int64_t len, float* acc, float* /*widened: unused, the rows are widened in registers*/) {
  constexpr int V = HD / 16;
  __m512 a[kMaxWideGroup][V];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < V; ++c) a[g][c] = _mm512_loadu_ps(acc + g * HD + 16 * c);
  for (int64_t o = 0; o < n; ++o) {
    __m512 v[V];
    for (int c = 0; c < V; ++c) v[c] = widen16(vb + o * HD + 16 * c);
    const float s = static_cast<float>(vs[o]);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * len + o] * s);
      for (int c = 0; c < V; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + g * HD + 16 * c, a[g][c]);
}
template <int HD>  // AVX2's float-cache loops: a float cache keeps the generic ones here (above)
inline void block_values_rows(const float*, const at::BFloat16*, int64_t, const float*, int64_t, int64_t, float*) {}
constexpr int kWideLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// The same block loops in 8 lanes for AVX2, for an int8 cache and a float32 one alike. Sixteen
// registers: scores take four keys at a time against one query head held in registers, values
// one head at a time, each block's int8 values widened once into a buffer the group's heads
// then read from L1. On a Zen 3 (9 query heads, 3 kv heads, head size 64, one thread) the
// generic loops took 1.25-1.55x these loops' time with an int8 cache and 1.05-1.2x with a
// float32 one, at 1 and 32 sequences of 160 and 512 tokens (docs/BENCHMARKS.md, round 16).

// rows x HD int8 codes -> floats, unscaled.
template <int HD>
inline void widen_int8_rows(const int8_t* codes, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < HD / 8; ++c) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + r * HD + 8 * c));
      _mm256_storeu_ps(dst + r * HD + 8 * c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
}

// Lane i of the result: the sum of a[i]'s 8 lanes.
inline __m128 sum_lanes4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Four bfloat16 scales as floats: a bfloat16 is a float's upper 16 bits.
inline __m128 scales4(const at::BFloat16* s) {
  const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
}

// scores[g * len + o] = (q_g . k_o) * scale_o for the block's n keys kb (n x HD floats: a float
// cache's rows, or int8 codes widened; ks their scales, or none: all 1), four keys at a time.
template <int HD>
inline void block_scores(const float* kb, const at::BFloat16* ks, int64_t n, const float* qf, int64_t group,
                         float* srow, int64_t len) {
  constexpr int V = HD / 8;
  for (int64_t g = 0; g < group; ++g) {
    __m256 q[V];
    for (int c = 0; c < V; ++c) q[c] = _mm256_loadu_ps(qf + g * HD + 8 * c);
    float* out = srow + g * len;
    int64_t o = 0;
    for (; o + 4 <= n; o += 4) {
      __m256 dot[4];
      for (int j = 0; j < 4; ++j) {
        const float* k = kb + (o + j) * HD;
        dot[j] = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
        for (int c = 1; c < V; ++c) dot[j] = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k + 8 * c), dot[j]);
      }
      const __m128 sums = sum_lanes4(dot);
      _mm_storeu_ps(out + o, ks ? _mm_mul_ps(sums, scales4(ks + o)) : sums);
    }
    for (; o < n; ++o) {
      __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int c = 0; c < V; ++c) dot[0] = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(kb + o * HD + 8 * c), dot[0]);
      out[o] = _mm_cvtss_f32(sum_lanes4(dot)) * (ks ? static_cast<float>(ks[o]) : 1.0f);
    }
  }
}

constexpr int64_t kMaxWideGroup = std::numeric_limits<int64_t>::max();  // one head at a time: any group

// An int8 cache's keys: widened into `widened` (n x HD floats), then dotted as a float block.
template <int HD>
inline void int8_block_scores(const int8_t* kb, const at::BFloat16* ks, int64_t n, const float* qf, int64_t group,
                              float* srow, int64_t len, float* widened) {
  widen_int8_rows<HD>(kb, n, widened);
  block_scores<HD>(widened, ks, n, qf, group, srow, len);
}

// acc_g += sum_o (p_g[o] * scale_o) rows_o for the block's n value rows (n x HD floats; scales
// vs, or none: all 1); p: the block's first probability of head 0 (head g's at g * len). Each
// head's accumulator is held in registers over the rows.
template <int HD>
inline void block_values_rows(const float* rows, const at::BFloat16* vs, int64_t n, const float* p, int64_t group,
                              int64_t len, float* acc) {
  constexpr int V = HD / 8;
  for (int64_t g = 0; g < group; ++g) {
    __m256 a[V];
    for (int c = 0; c < V; ++c) a[c] = _mm256_loadu_ps(acc + g * HD + 8 * c);
    for (int64_t o = 0; o < n; ++o) {
      const __m256 w = _mm256_set1_ps(vs ? p[g * len + o] * static_cast<float>(vs[o]) : p[g * len + o]);
      for (int c = 0; c < V; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows + o * HD + 8 * c), a[c]);
    }
    for (int c = 0; c < V; ++c) _mm256_storeu_ps(acc + g * HD + 8 * c, a[c]);
  }
}

// The same for int8 codes vb: widened once into `widened` (n x HD floats), then summed as rows.
template <int HD>
inline void block_values(const int8_t* vb, const at::BFloat16* vs, int64_t n, const float* p, int64_t group,
                         int64_t len, float* acc, float* widened) {
  widen_int8_rows<HD>(vb, n, widened);
  block_values_rows<HD>(widened, vs, n, p, group, len, acc);
}
constexpr int kWideLanes = 8;
#else
constexpr int kMaxWideGroup = 0;
template <int HD>
inline void block_scores(const float*, const at::BFloat16*, int64_t, const float*, int64_t, float*, int64_t) {}
template <int HD>
inline void int8_block_scores(const int8_t*, const at::BFloat16*, int64_t, const float*, int64_t, float*, int64_t,
                              float*) {}
template <int HD>
inline void block_values(const int8_t*, const at::BFloat16*, int64_t, const float*, int64_t, int64_t, float*, float*) {}
template <int HD>
inline void block_values_rows(const float*, const at::BFloat16*, int64_t, const float*, int64_t, int64_t, float*) {}
constexpr int kWideLanes = 0;
#endif

// One call's operands as the loops read them: q rows (q_stride apart), out [seqs, heads,
// head_dim], the caches and, for a 1-byte one, their scales.
template <typename T, typename C>
struct Decode {
  const T* q;
  int64_t q_stride;
  T* out;
  const C *k, *v;
  const at::BFloat16 *ks, *vs;
  const int64_t* tables;
  int64_t max_blocks;
  const int64_t* lens;
  int64_t heads, kv_heads, block_size, head_dim;
  double scale;
};

// One kv head's fp8 blocks as floats, kept while a thread's next item reads them too: a prompt's
// rows laid out as decode rows (ModelRunner._stack_takes_chunks) each read every block before
// them, and dequantizing each key and value through the table once per row made a 1,536-token
// prefill 3x SDPA's time. Slot b holds the block at position b of the tables that filled it
// (`ids`, -1 none), its first `rows` rows; a row's floats are the table's value times its scale
// however many rows share them, so every row's arithmetic is what it was.
struct BlockMemo {
  int64_t kh = -1;  // the kv head the slots hold; -1: none (each call starts so)
  std::vector<int64_t> ids, rows;
  std::vector<float> data;

  void reset(int64_t head, int64_t max_blocks, int64_t floats) {
    kh = head;
    ids.assign(max_blocks, -1);
    rows.assign(max_blocks, 0);
    if (static_cast<int64_t>(data.size()) < floats) data.resize(floats);
  }
  bool holds(int64_t head, int64_t b, int64_t id, int64_t n) const {
    return kh == head && ids[b] == id && rows[b] >= n;
  }
  // Block `id` at position b, its first n rows dequantized (those not yet): the slot's floats.
  template <typename C>
  const float* fill(int64_t b, int64_t id, int64_t n, const C* codes, const at::BFloat16* scales, int64_t block_size,
                    int64_t head_dim) {
    float* slot = data.data() + b * block_size * head_dim;
    const int64_t have = ids[b] == id ? rows[b] : 0;
    if (have < n) dequantize_rows(codes + have * head_dim, scales + have, n - have, head_dim, slot + have * head_dim);
    ids[b] = id;
    rows[b] = std::max(have, n);
    return slot;
  }
  // The block's first n rows as floats: the slot's when it holds them, else dequantized into the
  // slot (`keep`: the next item reads them too) or into `buf`.
  template <typename C>
  const float* rows_of(int64_t head, int64_t b, int64_t id, int64_t n, bool keep, const C* codes,
                       const at::BFloat16* scales, int64_t block_size, int64_t head_dim, float* buf) {
    if (holds(head, b, id, n)) return data.data() + b * block_size * head_dim;
    if (keep) return fill(b, id, n, codes, scales, block_size, head_dim);
    dequantize_rows(codes, scales, n, head_dim, buf);
    return buf;
  }
};

// A thread's buffers, reused across its items.
struct Scratch {
  std::vector<float> qf, acc, scores, buf;
  std::vector<int64_t> order;
  BlockMemo keys, values;
};

// Items [begin, end) one kv head after another (item = sequence * kv_heads + kv head), so that
// consecutive items of a prompt's rows read the same blocks.
inline void head_major(int64_t begin, int64_t end, int64_t kv_heads, std::vector<int64_t>& order) {
  order.clear();
  for (int64_t kh = 0; kh < kv_heads; ++kh)
    for (int64_t item = begin + ((kh - begin % kv_heads) % kv_heads + kv_heads) % kv_heads; item < end; item += kv_heads)
      order.push_back(item);
}

// Work items [begin, end) (item = sequence * kv_heads + kv head) on this thread.
template <typename T, typename C, int HD>
void decode_items(const Decode<T, C>& a, int64_t begin, int64_t end, Scratch& sc) {
  // KV element type as the loops read it: the cache's own, or float after dequantizing.
  using K = std::conditional_t<is_quantized<C>(), float, C>;
  // An int8 cache through the block loops above (AVX-512's 16 lanes or AVX2's 8: HD a multiple
  // of them, at most kMaxWideGroup query heads per kv head), and on AVX2 a float32 one too.
  constexpr bool wide_type = kWideLanes > 0 && std::is_same_v<C, int8_t> && HD > 0 && HD % std::max(kWideLanes, 1) == 0;
  const int64_t num_heads = a.heads, head_dim = HD > 0 ? HD : a.head_dim;
  const int64_t num_kv_heads = a.kv_heads, block_size = a.block_size;
  const int64_t group = num_heads / num_kv_heads, max_blocks = a.max_blocks;
  const bool wide = wide_type && group <= kMaxWideGroup;
  constexpr bool wide_float = kWideLanes == 8 && std::is_same_v<C, float> && HD > 0 && HD % 8 == 0;
  const T* qp = a.q;
  const C* kp = a.k;
  const C* vp = a.v;
  const at::BFloat16* ksp = a.ks;
  const at::BFloat16* vsp = a.vs;
  const int64_t* tables = a.tables;
  const int64_t* lens = a.lens;
  T* op = a.out;
  const double scale = a.scale;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  std::vector<float>&qf = sc.qf, &acc = sc.acc, &scores = sc.scores, &buf = sc.buf;
  qf.resize(group * head_dim);
  acc.resize(group * head_dim);
  buf.resize(is_quantized<C>() ? block_size * head_dim : 0);
  // fp8 codes are dequantized through a table, element by element: its blocks are shared
  // between a kv head's consecutive items (BlockMemo). int8 and float caches keep their loops.
  constexpr bool memo = std::is_same_v<C, c10::Float8_e4m3fn>;
  std::vector<int64_t>& order = sc.order;
  if constexpr (memo) {
    head_major(begin, end, num_kv_heads, order);
    sc.keys.kh = sc.values.kh = -1;  // another call's blocks: another layer or step
  }
  const int64_t count = end - begin;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t item = memo ? order[i] : begin + i;
    const int64_t next_item = i + 1 < count ? (memo ? order[i + 1] : item + 1) : -1;
    const int64_t s = item / num_kv_heads, kh = item % num_kv_heads, len = lens[s];
    const int64_t* table = tables + s * max_blocks;
    // Whether the next item is this head's and starts from the same block: then this item's
    // blocks are kept for it.
    bool keep = false;
    if constexpr (memo) {
      const int64_t s2 = next_item / num_kv_heads;
      keep = next_item >= 0 && next_item % num_kv_heads == kh && lens[s2] > 0 && len > 0 &&
             tables[s2 * max_blocks] == table[0];
      const int64_t floats = ((len + block_size - 1) / block_size) * block_size * head_dim;
      for (BlockMemo* m : {&sc.keys, &sc.values})
        if (keep && m->kh != kh) m->reset(kh, max_blocks, floats);
        else if (keep && static_cast<int64_t>(m->data.size()) < floats) m->data.resize(floats);
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d)
        qf[g * head_dim + d] = static_cast<float>(qp[s * a.q_stride + (kh * group + g) * head_dim + d]) * scale;
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
      } else if (next_item >= 0) {
        const int64_t s2 = next_item / num_kv_heads, kh2 = next_item % num_kv_heads;
        const int64_t next = tables[s2 * max_blocks] * num_kv_heads * block_size + kh2 * block_size;
        prefetch_bytes<3>(kp + next * head_dim, block_size * head_dim * sizeof(C));
      }
      prefetch_bytes<2>(vp + slice * head_dim, n * head_dim * sizeof(C));
      if constexpr (is_quantized<C>()) prefetch_bytes<2>(vsp + slice, n * 2);
      // And the keys two blocks ahead to L2: one block of a float cache is ~100 ns of work, less
      // than its next block's trip from memory (0.80-0.88x the time with a float32 cache; an
      // int8 one, its blocks a quarter the bytes and its work per byte higher, unchanged).
      if (b + 2 < num_blocks) {
        const int64_t far = table[b + 2] * num_kv_heads * block_size + kh * block_size;
        prefetch_bytes<2>(kp + far * head_dim, block_size * head_dim * sizeof(C));
        if constexpr (is_quantized<C>()) prefetch_bytes<2>(ksp + far, block_size * 2);
      }
      const K* kb;
      if constexpr (wide_float) {
        block_scores<HD>(kp + slice * head_dim, nullptr, n, qf.data(), group, scores.data() + b * block_size, len);
        continue;
      }
      if constexpr (wide_type) {
        if (wide) {
          int8_block_scores<HD>(kp + slice * head_dim, ksp + slice, n, qf.data(), group,
                                scores.data() + b * block_size, len, buf.data());
          continue;
        }
      }
      if constexpr (memo) {
        kb = sc.keys.rows_of(kh, b, table[b], n, keep, kp + slice * head_dim, ksp + slice, block_size, head_dim,
                             buf.data());
      } else if constexpr (is_quantized<C>()) {
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
      if constexpr (wide_float) {
        block_values_rows<HD>(vp + slice * head_dim, nullptr, n, scores.data() + b * block_size, group, len, acc.data());
        continue;
      }
      if constexpr (wide_type) {
        if (wide) {
          block_values<HD>(vp + slice * head_dim, vsp + slice, n, scores.data() + b * block_size, group, len,
                           acc.data(), buf.data());
          continue;
        }
      }
      const K* vb;
      if constexpr (memo) {
        vb = sc.values.rows_of(kh, b, table[b], n, keep, vp + slice * head_dim, vsp + slice, block_size, head_dim,
                             buf.data());
      } else if constexpr (is_quantized<C>()) {
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
}

template <typename T, typename C, int HD>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                   const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
                   double scale) {
  const int64_t num_seqs = q.size(0), num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const Decode<T, C> a{q.data_ptr<T>(), q.size(1) * q.size(2), out.data_ptr<T>(), k_cache.data_ptr<C>(),
                       v_cache.data_ptr<C>(), is_quantized<C>() ? k_scale.data_ptr<at::BFloat16>() : nullptr,
                       is_quantized<C>() ? v_scale.data_ptr<at::BFloat16>() : nullptr,
                       block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(),
                       q.size(1), num_kv_heads, block_size, q.size(2), scale};
  const int64_t* lens = a.lens;
  // One contiguous run of items a thread, split by work (an item's blocks, plus one for its
  // fixed steps) rather than by count: a step's rows put the decodes, long, before a prompt
  // chunk's rows, short, and an even count gave one thread the long ones (perf of the c=32
  // server: attention 9% of the samples on one thread, 6% on the other).
  const int64_t items = num_seqs * num_kv_heads;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds(parts + 1, items);
  {
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += num_kv_heads * ((lens[s] + block_size - 1) / block_size + 1);
    int64_t done = 0, part = 0;
    bounds[0] = 0;
    for (int64_t item = 0; item < items && part + 1 < parts; ++item) {
      done += (lens[item / num_kv_heads] + block_size - 1) / block_size + 1;
      while (part + 1 < parts && done * parts >= total * (part + 1)) bounds[++part] = item + 1;
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    Scratch scratch;
    decode_items<T, C, HD>(a, bounds[part_begin], bounds[part_end], scratch);
  });
}

// fn(std::integral_constant<int, HD>{}): HD is head_dim where it is a common one (the loops
// over a head then unroll fully), else 0 (read at run time).
template <typename Fn>
void with_head_dim(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    default: return fn(std::integral_constant<int, 0>{});
  }
}

template <typename T, typename C>
void decode_hd(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& k_scale, const torch::Tensor& v_scale, const torch::Tensor& bt,
               const torch::Tensor& sl, torch::Tensor& out, double scale) {
  with_head_dim(q.size(2), [&](auto hd) {
    decode_kernel<T, C, decltype(hd)::value>(q, k_cache, v_cache, k_scale, v_scale, bt, sl, out, scale);
  });
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

void raw::paged_decode_attention(const PagedDecode& p, int64_t begin, int64_t end) {
  thread_local Scratch scratch;  // grown once, then reused step after step
  if (end < 0) end = p.seqs * p.kv_heads;
  if (begin >= end) return;
  auto run = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    const Decode<float, C> a{p.q, p.q_stride, p.out, static_cast<const C*>(p.k_cache), static_cast<const C*>(p.v_cache),
                             p.k_scales, p.v_scales, p.block_tables, p.max_blocks, p.seq_lens, p.heads, p.kv_heads,
                             p.block_size, p.head_dim, p.scale};
    with_head_dim(p.head_dim, [&](auto hd) { decode_items<float, C, decltype(hd)::value>(a, begin, end, scratch); });
  };
  if (p.k_scales == nullptr) run(float{});
  else if (p.fp8) run(c10::Float8_e4m3fn{});
  else run(int8_t{});
}
