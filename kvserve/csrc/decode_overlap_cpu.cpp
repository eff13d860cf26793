// A small decode step's layers (up to llama.py's OVERLAP_MAX_ROWS rows) in one parallel region,
// the weight stream overlapping the serial work (issue 16: single-stream decode at the bandwidth
// limit).
//
// At one row a token reads every weight once, and between its projections come the norms,
// rotary, the KV write and attention: serial work, ~30% of the stack's time on an AVX2 Zen 3,
// during which memory idles and the other cores wait in the OpenMP pool (round 16's
// bench_decode_stack_hot.py: the stack took its weights' stream time plus its hot-cache time).
// Here thread 0 does that work while the other threads load the panels they will compute in
// this projection and the next into their own caches; then every thread computes its share.
// The attention, which grows with the context (at ~2K tokens ~45% of a token's time), is shared:
// a worker that has loaded its share of the o projection takes KV heads from the back of the
// layer's list while thread 0 takes them from the front (decode 0.84x the time at 2K tokens of
// context, 0.97x at 128; docs/BENCHMARKS.md issue 16 round 29).
// Thread 0's share (read from memory) is learnt per row count, layer and projection: a panel
// less each step it finishes last, one more when first. Any split gives the same bits: one output is
// one SIMD lane of the same kernel, whichever thread computes it.
// From split_rows_ rows up (llama.py's SPLIT_ROWS) the serial work, which grows with the rows,
// is no longer thread 0's: every thread runs it for its own rows between barriers (row by row
// the same loops, so the same bits), and nothing is loaded ahead. There the region still saves
// the ~14 parallel regions a layer of the per-kernel path opens (16-64 rows 0.86-0.97x the time
// on an AMX Xeon; docs/BENCHMARKS.md issue 16 round 30).
//
// Thread 0's serial work calls raw:: (cpu_kernels.h) on buffers this class owns, with every
// pointer and check taken before the region. The weight stream has just emptied the caches, so
// each ATen call there (a dispatch, an allocation, tensor metadata, its checks) cost 1.5-2 us
// where its arithmetic takes a tenth of that: the serial part of a step measured ~800 us with
// the tensor ops and ~445 us with raw:: (default model, int4 weights, int8 cache, ~160 tokens,
// Zen 4; docs/BENCHMARKS.md issue 16 round 27).
#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Per stage, a worker loads at most this much ahead. Above a Zen 3's 512 KiB L2 on purpose: the
// attention stage's gap is long enough for more, and lines the L2 pushes out go to the L3.
constexpr int64_t kLoadAheadBudget = 1024 * 1024;

using Clock = std::chrono::steady_clock;

// Waiting for thread 0: spin a while (its serial parts take microseconds), then yield, so a
// thread that shares its core with it (more threads than cores, a loaded host) lets it run.
inline void relax(int64_t& spins) {
#if defined(__x86_64__)
  if (++spins < 4096) return _mm_pause();
#endif
  std::this_thread::yield();
}

// Brings lines into this core's caches with loads: on Zen 3 a run of prefetch instructions
// is mostly dropped (a 128 KiB span prefetched then read: the read still at memory speed, ~17
// GB/s; loaded then read: ~60 GB/s).
inline void touch_lines(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) (void)*reinterpret_cast<const volatile char*>(p + i);
}

// A projection's bias added to its output rows [r0, r1) of width n, as Python's y + bias (the
// same float adds, so the same bits); nothing where it has none.
inline void add_bias(float* y, const float* bias, int64_t n, int64_t r0, int64_t r1) {
  if (bias == nullptr) return;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < n; ++j) y[r * n + j] += bias[j];
}

// Thread t's panels of a projection whose first `lead` panels are thread 0's (all of them
// where the region got one thread); the rest split evenly between threads 1 .. T-1.
inline std::pair<int64_t, int64_t> share(int64_t panels, int64_t lead, int t, int threads) {
  if (threads == 1) return {0, panels};
  if (t == 0) return {0, lead};
  const int64_t per = (panels - lead + threads - 2) / (threads - 1);
  const int64_t b = std::min(panels, lead + (t - 1) * per);
  return {b, std::min(panels, b + per)};
}

// A layer's attention work items (sequence x KV head) shared between thread 0, which takes them
// from the front as soon as its serial part is done, and the workers, which take them from the
// back once they have loaded their share of the projection that follows. One word holds the
// unclaimed range [front, back) and the items the workers have claimed but not finished.
class WorkSpan {
 public:
  void reset(int64_t items) { word_.store(pack(0, items, 0), std::memory_order_relaxed); }
  // The next item from the front (thread 0) or the back (a worker, which must call finish after
  // it); -1 when none is left.
  int64_t claim(bool from_back) {
    uint64_t w = word_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = field(w, 0), back = field(w, 1), pending = field(w, 2);
      if (front >= back) return -1;
      const uint64_t next = from_back ? pack(front, back - 1, pending + 1) : pack(front + 1, back, pending);
      if (word_.compare_exchange_weak(w, next, std::memory_order_relaxed)) return from_back ? back - 1 : front;
    }
  }
  // A worker's claimed item is done: its results are visible to whoever sees settled().
  void finish() { word_.fetch_sub(uint64_t{1} << (2 * kBits), std::memory_order_release); }
  bool settled() const {  // nothing left to claim and nothing claimed unfinished
    const uint64_t w = word_.load(std::memory_order_acquire);
    return field(w, 0) >= field(w, 1) && field(w, 2) == 0;
  }

 private:
  static constexpr int kBits = 21;  // per field: up to 2M items a layer
  static uint64_t pack(int64_t front, int64_t back, int64_t pending) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << kBits |
           static_cast<uint64_t>(pending) << (2 * kBits);
  }
  static int64_t field(uint64_t w, int i) { return static_cast<int64_t>(w >> (i * kBits) & ((1ull << kBits) - 1)); }
  std::atomic<uint64_t> word_{0};
};

}  // namespace

bool OverlappedStack::has_panels(const Projection& p, QuantizeFn quantize) {
  if (quantize == nullptr || (quantize_ != nullptr && quantize_ != quantize) || p.panels == nullptr) return false;
  TORCH_CHECK(p.codes.dim() == 3 && p.codes.size(2) == 64 && p.codes.is_contiguous() && p.scales.is_contiguous() &&
              p.k() % 32 == 0, "projection weights: contiguous panels");
  return true;
}

bool OverlappedStack::accepts(const Layer& first, const Layer& l, QuantizeFn quantize) {
  for (int j = 0; j < 4; ++j) {
    const Projection &p = l.projection(j), &f = first.projection(j);
    if (!has_panels(p, quantize)) return false;
    if (p.n != f.n || p.k() != f.k()) return false;  // forward sizes its buffers from the first layer
  }
  quantize_ = quantize;
  return true;
}

bool OverlappedStack::accepts(const Projection& lm_head, QuantizeFn quantize) {
  if (!has_panels(lm_head, quantize)) return false;
  quantize_ = quantize;
  return true;
}

void OverlappedStack::prepare(const std::vector<Layer>& layers, const Head* head, const StackShape& s,
                              int64_t hidden) {
  const void* head_codes = head != nullptr ? head->lm_head.codes.data_ptr() : nullptr;
  if (prepared_layers_ == layers.size() && prepared_head_ == head_codes && !stages_.empty()) return;
  const Layer& first = layers[0];
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  TORCH_CHECK(first.qkv.k() == hidden && first.o.k() == q_size && first.gate_up.k() == hidden &&
                  first.down.k() == first.gate_up.n / 2 && first.qkv.n == q_size + 2 * kv_size &&
                  first.o.n == hidden && first.down.n == hidden && (head == nullptr || head->lm_head.k() == hidden),
              "projection shapes");
  stages_.clear(), layer_ptrs_.clear();
  auto add = [&](const Projection& p) {
    stages_.push_back({p.panels, static_cast<const char*>(p.codes.data_ptr()),
                       static_cast<const char*>(p.scales.data_ptr()), p.n, p.k(), p.num_panels(),
                       p.codes_per_panel(), p.scales_per_panel()});
  };
  auto norm = [&](const at::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden,
                "norm weights: contiguous float32 [hidden]");
    return w.data_ptr<float>();
  };
  for (const Layer& l : layers) {
    for (int j = 0; j < 4; ++j) add(l.projection(j));
    TORCH_CHECK(l.coded_cache == first.coded_cache, "every layer's cache of one type");
    if (l.coded_cache)
      TORCH_CHECK(l.k_scales.scalar_type() == at::kBFloat16 && l.k_scales.is_contiguous() &&
                      l.v_scales.scalar_type() == at::kBFloat16 && l.v_scales.is_contiguous() &&
                      l.v_scales.numel() == l.k_scales.numel() && l.k_scales.numel() == first.k_scales.numel(),
                  "1-byte cache scales: contiguous bfloat16 [blocks, kv_heads, block_size]");
    layer_ptrs_.push_back({norm(l.input_norm), norm(l.post_norm),
                           l.coded_cache ? l.k_scales.data_ptr<at::BFloat16>() : nullptr,
                           l.coded_cache ? l.v_scales.data_ptr<at::BFloat16>() : nullptr,
                           {l.qkv.bias_ptr(), l.o.bias_ptr(), l.gate_up.bias_ptr(), l.down.bias_ptr()}});
  }
  if (head != nullptr) {
    add(head->lm_head);
    norm(head->norm);
  }
  prepared_layers_ = layers.size(), prepared_head_ = head_codes;
}

at::Tensor OverlappedStack::forward(const std::vector<Layer>& layers, const Head* head, const StackShape& s,
                                    at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                    const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                                    const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, double scale) {
  const int64_t rows = x.size(0), n_layers = layers.size();
  const int threads = at::get_num_threads();
  const Layer& first = layers[0];
  const int64_t hidden = x.size(1), q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const int64_t inter = first.gate_up.n / 2;
  prepare(layers, head, s, hidden);
  const int64_t n_stages = stages_.size();
  int64_t max_k = 0;
  for (const Stage& st : stages_) max_k = std::max(max_k, st.k);
  q_.resize(rows * max_k + 64), d_.resize(rows * max_k / 32), s_.resize(rows * max_k / 32), sum_.resize(rows * max_k / 32);
  // The codes start on a cache line: the AMX kernels load 16 rows of 32 bytes a tile from them,
  // and rows straddling two lines cost both (quant_matmul_cpu.cpp, line_aligned).
  int8_t* const qcodes = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(q_.data()) + 63) & ~uintptr_t{63});
  std::vector<int64_t>& lead_of = leads_[rows];  // the split learnt for this many rows
  for (int64_t i = lead_of.size(); i < n_stages; ++i) lead_of.push_back(stages_[i].num_panels / threads);
  // Outputs, one per projection kind (each read before the next layer writes it again; kept
  // from step to step), and the head's logits, returned.
  for (int j = 0; j < 4; ++j) out_[j].resize(rows * first.projection(j).n);
  at::Tensor logits = head != nullptr ? at::empty({rows, head->lm_head.n}, x.options()) : at::Tensor();
  // Thread 0's serial work reads and writes raw buffers through raw:: (cpu_kernels.h); the step's
  // inputs are checked here.
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * s.head_dim && sin.numel() == cos.numel(),
              "cos/sin: contiguous float32 [rows, head_dim]");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.size(3) == s.kv_heads &&
                  kv_cache.size(5) == s.head_dim &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kChar ||
                   kv_cache.scalar_type() == at::kFloat8_e4m3fn),
              "kv_cache: contiguous float32, int8 or float8_e4m3fn [layers, 2, blocks, kv_heads, block_size, head_dim]");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn, coded = fp8 || kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(first.coded_cache == coded, "a 1-byte cache comes with its scales");
  if (coded)
    TORCH_CHECK(first.k_scales.numel() * s.head_dim == kv_cache.stride(1), "one cache scale a K / V vector");
  const int64_t blocks = kv_cache.size(2), block_size = kv_cache.size(4), n_slots = slot_blocks.numel();
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_offsets.numel() == n_slots &&
                  n_slots <= rows,
              "int64 slot blocks and offsets, at most one a row");
  // The first `seqs` rows are the step's sequences; rows past them pad the batch to a bucket size
  // (shape_buckets.py): computed, never stored, their attention output zero.
  const int64_t seqs = seq_lens.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) >= seqs && seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seqs <= rows,
              "int64 block tables and lengths, one a sequence, at most one a row");
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t r = 0; r < seqs; ++r) {
    TORCH_CHECK(lens[r] > 0 && lens[r] <= max_blocks * block_size, "sequence length out of range");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[r * max_blocks + b] >= 0 && tables[r * max_blocks + b] < blocks, "block table entry out of range");
  }
  const raw::KvSlots slots{slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), n_slots, s.kv_heads,
                           block_size, s.head_dim};
  raw::check_slots(slots, blocks);
  const float* final_norm = head != nullptr ? head->norm.data_ptr<float>() : nullptr;
  char* const kv_base = static_cast<char*>(kv_cache.data_ptr());
  const int64_t cache_bytes = kv_cache.stride(1) * kv_cache.element_size();  // one layer's K (or V) cache
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  // Thread 0's activations: the normed stream, the attention's output, the MLP's product.
  normed_.resize(rows * hidden), attn_.resize(rows * q_size), act_.resize(rows * inter);
  std::fill(attn_.begin() + seqs * q_size, attn_.end(), 0.0f);  // the padding rows' attention
  float* yp[5];
  for (int j = 0; j < 4; ++j) yp[j] = out_[j].data();
  yp[4] = logits.defined() ? logits.data_ptr<float>() : nullptr;

  std::atomic<int64_t> ready{0};  // the stages thread 0 has finished its serial part of
  std::atomic<int64_t> shared_go{0};  // the stages whose shared items may be claimed
  WorkSpan items;                     // that stage's items
  const int64_t items_per_layer = seqs * s.kv_heads;
  TORCH_CHECK(items_per_layer < (1 << 21), "too many attention items for one step");
  std::atomic<bool> failed{false}, claimed{false};
  std::exception_ptr error;
  auto fail = [&](std::exception_ptr e) {  // the first error is the one rethrown
    if (!claimed.exchange(true)) error = e;
    failed.store(true, std::memory_order_relaxed);
  };
  std::vector<Clock::time_point> done(threads + 1);
  // From split_rows_ rows up every thread takes a share of the rows in each stage's serial part
  // (its work grows with the rows, and at 32-64 rows it outweighs what loading ahead saves).
  const bool split = split_rows_ > 0 && rows >= split_rows_;
  // The KV slots of rows [r0, r1) (rows past the step's slots pad the batch: none).
  auto slots_of = [&](int64_t r0, int64_t r1) {
    raw::KvSlots part = slots;
    const int64_t b = std::min(r0, n_slots), e = std::min(r1, n_slots);
    part.blk += b, part.off += b, part.n = e - b;
    return part;
  };

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();  // nt may be fewer than asked
    // Worker t's share of stage `st`'s projection into its caches while thread 0 has not
    // finished the serial part of stage `now`, up to `budget` bytes; returns the budget left.
    auto warm = [&](int64_t st, int64_t now, int64_t budget) {
      const Stage& p = stages_[st];
      const auto [b, e] = share(p.num_panels, lead_of[st], t, nt);
      const int64_t cb = p.codes_bytes, sb = p.scales_bytes;
      for (int64_t q = b; q < e && budget > 0 && ready.load(std::memory_order_acquire) <= now; ++q) {
        touch_lines(p.codes + q * cb, cb);
        touch_lines(p.scales + q * sb, sb);
        budget -= cb + sb;
      }
      return budget;
    };
    // Stage `st`: thread 0 runs `serial(0, rows)` and quantizes h (the activations it leaves),
    // while the others load their share of its projection, then of the next one; then all
    // compute their shares into `out`. A stage with a `shared` part (the attention) runs it after
    // the serial part, before the quantization, its items claimed through `items`: shared(i)
    // computes item i. With `split`, each thread runs serial(r0, r1) and the quantization for its
    // own rows instead, between barriers, and loads nothing ahead.
    auto run_stage = [&](int64_t st, float* out, const float* h, auto&& serial, auto&& shared) {
      constexpr bool has_shared = !std::is_same_v<std::decay_t<decltype(shared)>, std::nullptr_t>;
      const Stage& p = stages_[st];
      int64_t& lead = lead_of[st];
      const int64_t k = p.k;
      auto attempt = [&](auto&& fn) {  // fn() unless a thread has failed; its error recorded
        if (failed.load(std::memory_order_relaxed)) return;
        try {
          fn();
        } catch (...) {
          fail(std::current_exception());
        }
      };
      // h's rows [r0, r1) quantized for the projection
      auto quantize_rows = [&](int64_t r0, int64_t r1) {
        const int64_t g = k / 32;
        quantize_(h + r0 * k, r1 - r0, k, qcodes + r0 * k, d_.data() + r0 * g, s_.data() + r0 * g,
                  sum_.data() + r0 * g);
      };
      // Attention items until none is left: thread 0 from the front, a worker from the back
      // (each of its items finished, so thread 0 can wait for them: WorkSpan::settled).
      auto take_items = [&](auto&& item, bool from_back) {
        for (int64_t i = items.claim(from_back); i >= 0; i = items.claim(from_back)) {
          attempt([&] { item(i); });
          if (from_back) items.finish(), helped_.fetch_add(1, std::memory_order_relaxed);
        }
      };
      if (split) {
        const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
        if constexpr (has_shared) {
          if (t == 0) items.reset(failed.load(std::memory_order_relaxed) ? 0 : items_per_layer);
        }
        attempt([&] { serial(r0, r1); });
#pragma omp barrier
        if constexpr (has_shared) {  // every row's K and V are in: the items, then every output
          take_items(shared, t != 0);
#pragma omp barrier
        }
        attempt([&] { quantize_rows(r0, r1); });
#pragma omp barrier
      } else if (t == 0) {
        attempt([&] { serial(0, rows); });
        if constexpr (has_shared) {
          items.reset(failed.load(std::memory_order_relaxed) ? 0 : items_per_layer);
          shared_go.store(st + 1, std::memory_order_release);
          take_items(shared, false);
          for (int64_t spins = 0; !items.settled();) relax(spins);
        }
        attempt([&] { quantize_rows(0, rows); });
        ready.store(st + 1, std::memory_order_release);
      } else {
        const int64_t budget = warm(st, st, kLoadAheadBudget);
        if constexpr (has_shared) {  // then help with the items thread 0 has not reached
          for (int64_t spins = 0; shared_go.load(std::memory_order_acquire) <= st;) relax(spins);
          take_items(shared, true);
        }
        if (st + 1 < n_stages) warm(st + 1, st, budget);
        for (int64_t spins = 0; ready.load(std::memory_order_acquire) <= st;) relax(spins);
      }
      if (!failed.load(std::memory_order_relaxed)) {
        const auto [b, e] = share(p.num_panels, lead, t, nt);
        p.panels(p.codes, p.scales, p.n, k, qcodes, d_.data(), s_.data(), sum_.data(), out, rows, b, e);
      }
      done[t] = Clock::now();
#pragma omp barrier
      if (t == 0 && nt > 1) {  // learn the split: a panel less for thread 0 if it finished last, more if first
        Clock::time_point others = done[1];
        for (int w = 2; w < nt; ++w) others = std::max(others, done[w]);
        if (done[0] > others && lead > 0) --lead;
        else if (done[0] < others && lead < p.num_panels) ++lead;
      }
    };

    // Each projection's bias goes into its output in the serial part of the stage that reads it.
    for (int64_t i = 0; i < n_layers; ++i) {
      const LayerPtrs& l = layer_ptrs_[i];
      run_stage(4 * i, yp[0], normed_.data(), [&](int64_t r0, int64_t r1) {
        // the previous layer's MLP output into the residual stream, then the input norm
        if (i > 0) add_bias(yp[3], layer_ptrs_[i - 1].bias[3], hidden, r0, r1);
        raw::add_rms_norm(xp + r0 * hidden, hidden, i > 0 ? yp[3] + r0 * hidden : nullptr, hidden, l.input_norm,
                          normed_.data() + r0 * hidden, r1 - r0, hidden, static_cast<float>(s.eps));
      }, nullptr);
      float* const qkv = yp[0];
      const int64_t w = first.qkv.n;  // a row of qkv: q | k | v
      char *const k_cache = kv_base + 2 * i * cache_bytes, *const v_cache = k_cache + cache_bytes;
      run_stage(4 * i + 1, yp[1], attn_.data(), [&](int64_t r0, int64_t r1) {
        add_bias(qkv, l.bias[0], w, r0, r1);
        float* const row = qkv + r0 * w;
        const float *const c = cp + r0 * s.head_dim, *const sn = sp + r0 * s.head_dim;
        raw::rotary(row, r1 - r0, s.heads, s.head_dim, w, s.head_dim, c, sn);
        raw::rotary(row + q_size, r1 - r0, s.kv_heads, s.head_dim, w, s.head_dim, c, sn);
        const raw::KvSlots part = slots_of(r0, r1);
        if (coded)
          raw::kv_write_codes(k_cache, v_cache, fp8, l.k_scales, l.v_scales, row + q_size, w, s.head_dim,
                              row + q_size + kv_size, w, s.head_dim, part);
        else
          raw::kv_write(reinterpret_cast<float*>(k_cache), reinterpret_cast<float*>(v_cache), row + q_size, w,
                        s.head_dim, row + q_size + kv_size, w, s.head_dim, part);
      }, [&](int64_t item) {  // the attention, its (sequence, KV head) items shared by the threads
        raw::paged_decode_attention({qkv, w, attn_.data(), k_cache, v_cache, l.k_scales, l.v_scales, fp8, tables,
                                     max_blocks, lens, seqs, s.heads, s.kv_heads, block_size, s.head_dim, scale},
                                    item, item + 1);
      });
      run_stage(4 * i + 2, yp[2], normed_.data(), [&](int64_t r0, int64_t r1) {
        add_bias(yp[1], l.bias[1], hidden, r0, r1);
        raw::add_rms_norm(xp + r0 * hidden, hidden, yp[1] + r0 * hidden, hidden, l.post_norm,
                          normed_.data() + r0 * hidden, r1 - r0, hidden, static_cast<float>(s.eps));
      }, nullptr);
      run_stage(4 * i + 3, yp[3], act_.data(), [&](int64_t r0, int64_t r1) {
        add_bias(yp[2], l.bias[2], first.gate_up.n, r0, r1);
        raw::silu_mul(yp[2] + r0 * first.gate_up.n, first.gate_up.n, act_.data() + r0 * inter, r1 - r0, inter);
      }, nullptr);
      if (failed.load(std::memory_order_relaxed)) break;  // read after the stage's barrier: all agree
    }
    if (head != nullptr && !failed.load(std::memory_order_relaxed))
      run_stage(n_stages - 1, yp[4], normed_.data(), [&](int64_t r0, int64_t r1) {
        add_bias(yp[3], layer_ptrs_[n_layers - 1].bias[3], hidden, r0, r1);
        raw::add_rms_norm(xp + r0 * hidden, hidden, yp[3] + r0 * hidden, hidden, final_norm,
                          normed_.data() + r0 * hidden, r1 - r0, hidden, static_cast<float>(s.eps));
      }, nullptr);
  }
  if (error) std::rethrow_exception(error);
  ++steps_;
  if (head != nullptr) return logits;
  add_bias(yp[3], layer_ptrs_[n_layers - 1].bias[3], hidden, 0, rows);
  for (int64_t i = 0; i < rows * hidden; ++i) xp[i] += yp[3][i];  // the last MLP output, as x.add_
  return x;
}
