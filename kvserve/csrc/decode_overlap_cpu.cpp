// A one-row decode step's layers in one parallel region, the weight stream overlapping the
// serial work (issue 16: single-stream decode at the bandwidth limit).
//
// At one row a token reads every weight once, and between its projections come the norms,
// rotary, the KV write and attention: serial work, ~30% of the stack's time on an AVX2 Zen 3,
// during which memory idles and the other cores wait in the OpenMP pool (round 16's
// bench_decode_stack_hot.py: the stack took its weights' stream time plus its hot-cache time).
// Here thread 0 does that work while the other threads load the panels they will compute in
// this projection and the next into their own caches; then every thread computes its share.
// Thread 0's share (read from memory) is learnt per layer and projection: a panel less each
// step it finishes last, one more when first. Any split gives the same bits: one output is
// one SIMD lane of the same kernel, whichever thread computes it.
#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
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

// Thread t's panels of a projection whose first `lead` panels are thread 0's (all of them
// where the region got one thread); the rest split evenly between threads 1 .. T-1.
inline std::pair<int64_t, int64_t> share(int64_t panels, int64_t lead, int t, int threads) {
  if (threads == 1) return {0, panels};
  if (t == 0) return {0, lead};
  const int64_t per = (panels - lead + threads - 2) / (threads - 1);
  const int64_t b = std::min(panels, lead + (t - 1) * per);
  return {b, std::min(panels, b + per)};
}

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

at::Tensor OverlappedStack::forward(const std::vector<Layer>& layers, const Head* head, const StackShape& s,
                                    at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                    const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                                    const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, double scale) {
  const int64_t rows = x.size(0), n_layers = layers.size();
  const int threads = at::get_num_threads();
  const Layer& first = layers[0];
  // The stages in order: a layer's four projections, then the head's lm_head.
  std::vector<const Projection*> order;
  order.reserve(n_layers * 4 + 1);
  for (const Layer& l : layers)
    for (int j = 0; j < 4; ++j) order.push_back(&l.projection(j));
  if (head != nullptr) order.push_back(&head->lm_head);
  const int64_t n_stages = order.size();
  int64_t max_k = 0;
  for (const Projection* p : order) max_k = std::max(max_k, p->k());
  q_.resize(rows * max_k), d_.resize(rows * max_k / 32), s_.resize(rows * max_k / 32), sum_.resize(rows * max_k / 32);
  for (int64_t i = lead_.size(); i < n_stages; ++i) lead_.push_back(order[i]->num_panels() / threads);
  // Outputs, one per projection kind (the head's last): each is read before the next layer
  // writes it again.
  at::Tensor y[5] = {at::empty({rows, first.qkv.n}, x.options()), at::empty({rows, first.o.n}, x.options()),
                     at::empty({rows, first.gate_up.n}, x.options()), at::empty({rows, first.down.n}, x.options()),
                     head != nullptr ? at::empty({rows, head->lm_head.n}, x.options()) : at::Tensor()};
  std::atomic<int64_t> ready{0};  // the stages thread 0 has finished its serial part of
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::vector<Clock::time_point> done(threads + 1);
  at::Tensor h;  // thread 0's: the activations the next projection multiplies

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();  // nt may be fewer than asked
    // Worker t's share of stage `st`'s projection into its caches while thread 0 has not
    // finished the serial part of stage `now`, up to `budget` bytes; returns the budget left.
    auto warm = [&](int64_t st, int64_t now, int64_t budget) {
      const Projection& p = *order[st];
      const auto [b, e] = share(p.num_panels(), lead_[st], t, nt);
      const char* codes = static_cast<const char*>(p.codes.data_ptr());
      const char* scales = static_cast<const char*>(p.scales.data_ptr());
      const int64_t cb = p.codes_per_panel(), sb = p.scales_per_panel();
      for (int64_t q = b; q < e && budget > 0 && ready.load(std::memory_order_acquire) <= now; ++q) {
        touch_lines(codes + q * cb, cb);
        touch_lines(scales + q * sb, sb);
        budget -= cb + sb;
      }
      return budget;
    };
    // Stage `st`: thread 0 runs `serial` (which leaves h) and quantizes h, while the others
    // load their share of its projection, then of the next one; then all compute their shares
    // into `out`.
    auto run_stage = [&](int64_t st, const at::Tensor& out, auto&& serial) {
      const Projection& p = *order[st];
      int64_t& lead = lead_[st];
      const int64_t k = p.k();
      if (t == 0) {
        if (!failed.load(std::memory_order_relaxed)) {
          try {
            serial();
            TORCH_CHECK(h.is_contiguous() && h.size(0) == rows && h.size(1) == k, "activations [rows, ", k, "]");
            quantize_(h.data_ptr<float>(), rows, k, q_.data(), d_.data(), s_.data(), sum_.data());
          } catch (...) {
            error = std::current_exception();
            failed.store(true, std::memory_order_relaxed);
          }
        }
        ready.store(st + 1, std::memory_order_release);
      } else {
        const int64_t budget = warm(st, st, kLoadAheadBudget);
        if (st + 1 < n_stages) warm(st + 1, st, budget);
        for (int64_t spins = 0; ready.load(std::memory_order_acquire) <= st;) relax(spins);
      }
      if (!failed.load(std::memory_order_relaxed)) {
        const auto [b, e] = share(p.num_panels(), lead, t, nt);
        p.panels(p.codes.data_ptr(), p.scales.data_ptr(), p.n, k, q_.data(), d_.data(), s_.data(), sum_.data(),
                 out.data_ptr<float>(), rows, b, e);
      }
      done[t] = Clock::now();
#pragma omp barrier
      if (t == 0 && nt > 1) {  // learn the split: a panel less for thread 0 if it finished last, more if first
        Clock::time_point others = done[1];
        for (int w = 2; w < nt; ++w) others = std::max(others, done[w]);
        if (done[0] > others && lead > 0) --lead;
        else if (done[0] < others && lead < p.num_panels()) ++lead;
      }
    };

    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& l = layers[i];
      run_stage(4 * i, y[0], [&] {
        if (i > 0) x.add_(y[3]);  // the previous layer's MLP output into the residual stream
        h = rms_norm(x, l.input_norm, s.eps);
      });
      run_stage(4 * i + 1, y[1], [&] {
        h = attend(l, s, i, y[0], cos, sin, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens, scale)
                .view({rows, s.heads * s.head_dim});
      });
      run_stage(4 * i + 2, y[2], [&] { h = add_rms_norm(x, y[1], l.post_norm, s.eps); });
      run_stage(4 * i + 3, y[3], [&] { h = silu_mul(y[2]); });
      if (failed.load(std::memory_order_relaxed)) break;  // read after the stage's barrier: all agree
    }
    if (head != nullptr && !failed.load(std::memory_order_relaxed))
      run_stage(n_stages - 1, y[4], [&] {
        x.add_(y[3]);
        h = rms_norm(x, head->norm, s.eps);
      });
  }
  if (error) std::rethrow_exception(error);
  ++steps_;
  if (head != nullptr) return y[4];
  x.add_(y[3]);
  return x;
}
