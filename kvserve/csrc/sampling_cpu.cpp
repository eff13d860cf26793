// Greedy's pick: the index of each row's largest logit, as torch.max(x, -1).indices gives it
// (the first on ties; a row holding NaN gives its first NaN), for float32 rows on the CPU.
//
// torch.max reads the rows once but, at 64 vocabulary-wide rows fresh from the lm_head, took
// ~2 ms of a ~35 ms decode step; here each row is a vectorized max, an integer NaN check on
// the same pass, then a search for the first equal value one 64-float chunk at a time.
// Comparisons are explicit (intrinsics, bit tests) so -ffast-math cannot assume NaN away.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline bool is_nan_bits(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (is_nan_bits(bits_of(x[i]))) return i;
  return -1;
}

// The row's maximum and whether it holds a NaN (the maximum is only used where it does not).
float row_max(const float* x, int64_t n, bool* has_nan) {
  int64_t i = 0;
  float m = x[0];
  bool nan = false;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vm = _mm512_loadu_ps(x);
    __mmask16 bad = 0;
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      bad |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf);
      vm = _mm512_max_ps(vm, v);
    }
    nan = bad != 0;
    m = _mm512_reduce_max_ps(vm);
  }
#elif defined(__AVX2__)
  if (n >= 8) {  // the same pass in 8 lanes (an AVX2 CPU had the scalar loop: ~50 us a 49k-float row)
    __m256 vm = _mm256_loadu_ps(x);
    __m256i bad = _mm256_setzero_si256();
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf));
      vm = _mm256_max_ps(vm, v);
    }
    nan = !_mm256_testz_si256(bad, bad);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  }
#endif
  for (; i < n; ++i) {
    if (is_nan_bits(bits_of(x[i]))) nan = true;
    else if (x[i] > m) m = x[i];
  }
  *has_nan = nan;
  return m;
}

int64_t first_equal(const float* x, int64_t n, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 64 <= n; i += 64) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ) |
                    _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i + 16), vm, _CMP_EQ_OQ) |
                    _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i + 32), vm, _CMP_EQ_OQ) |
                    _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i + 48), vm, _CMP_EQ_OQ);
    if (hit) break;
  }
#elif defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 32 <= n; i += 32) {
    const __m256 hit = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vm, _CMP_EQ_OQ)),
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), vm, _CMP_EQ_OQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), vm, _CMP_EQ_OQ)));
    if (_mm256_movemask_ps(hit)) break;
  }
#endif
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return n - 1;  // unreachable: m is one of the row's values
}

}  // namespace

torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) > 0,
              "row_argmax: contiguous float32 [rows, n > 0]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* row = xp + r * n;
      bool nan = false;
      const float m = row_max(row, n, &nan);
      op[r] = nan ? first_nan(row, n) : first_equal(row, n, m);
    }
  });
  return out;
}
