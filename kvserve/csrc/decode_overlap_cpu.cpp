// A one-row decode step's layers in one parallel region, the weight stream overlapping the
// serial work (issue 16: single-stream decode at the bandwidth limit).
//
// At one row a token reads every weight once, and between its projections come the norms,
// rotary, the KV write and attention: serial work, ~30% of the stack's time on an AVX2 Zen 3,
// during which memory idles and the other cores wait in the OpenMP pool (round 16's
// bench_decode_stack_hot.py: the stack took its weights' stream time plus its hot-cache time).
// Here one thread does that work while the others load the panels they will compute in this
// projection and the next into their own caches; then every thread computes its share. The
// serial thread's share (read from memory) is learnt per layer and projection: a panel less
// each step it finishes last, one more when first. Any split gives the same bits: one output
// is one SIMD lane of the same kernel, whichever thread computes it.
//
// No barrier between stages: each stage's serial part is run by thread 0, or by another thread
// when thread 0 is late, and then every thread computes its region of the projection in chunks, flagging each, and
// then whatever chunks of the other regions are not flagged yet, from the top down. So a thread
// that loses its core for a while (on a machine with as many cores as threads: the API process,
// the client; issue 16's c=1 inter-token latency) holds up nothing unless it was running a serial
// part, where a barrier made the whole step wait for it. A thread that resumes inside a chunk
// another has since computed may finish it with a later stage's activations: every stage has its
// own output buffer, read once by the next stage's serial part before those activations change,
// so that late write lands where nobody reads.

#include "decode_stack.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Per stage, a worker loads at most this much ahead. Above a Zen 3's 512 KiB L2 on purpose: the
// attention stage's gap is long enough for more, and lines the L2 pushes out go to the L3.
constexpr int64_t kLoadAheadBudget = 1024 * 1024;
// A worker computes, and flags, its share in chunks of this many panels: what thread 0 may
// compute twice when it reaches a chunk the worker is in the middle of.
constexpr int64_t kChunkPanels = 4;
// How long the others wait for thread 0 to take a stage's serial part before one of them does:
// thread 0 gets there within a chunk or two of them unless it lost its core.
constexpr int64_t kOwnerGraceMicros = 30;

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
  const std::vector<int64_t> lead = lead_;  // this call's split (the stages' owners learn into lead_ meanwhile)
  // Each stage's chunk flags start at its first panel's index.
  std::vector<int64_t> flag_at(n_stages + 1, 0);
  for (int64_t i = 0; i < n_stages; ++i) flag_at[i + 1] = flag_at[i] + order[i]->num_panels();
  if (flags_size_ < flag_at[n_stages]) {
    flags_size_ = flag_at[n_stages];
    flags_.reset(new std::atomic<uint32_t>[flags_size_]);
    for (int64_t i = 0; i < flags_size_; ++i) flags_[i].store(0, std::memory_order_relaxed);
  }
  if (claims_size_ < n_stages) {
    claims_size_ = n_stages;
    claims_.reset(new std::atomic<uint32_t>[claims_size_]);
    for (int64_t i = 0; i < claims_size_; ++i) claims_[i].store(0, std::memory_order_relaxed);
  }
  if (++generation_ == 0) ++generation_;  // a flag or claim is set when it holds this call's generation
  const uint32_t gen = generation_;
  // The layers' stage outputs, one buffer each, kept between calls; the head's logits are new.
  if (stage_rows_ != rows || static_cast<int64_t>(stage_out_.size()) != n_layers * 4) {
    int64_t total = 0;
    for (int64_t i = 0; i < n_layers * 4; ++i) total += order[i]->n;
    stage_buf_ = at::empty({rows * total}, x.options());
    stage_out_.clear();
    for (int64_t i = 0, at_ = 0; i < n_layers * 4; at_ += rows * order[i]->n, ++i)
      stage_out_.push_back(stage_buf_.narrow(0, at_, rows * order[i]->n).view({rows, order[i]->n}));
    stage_rows_ = rows;
  }
  const at::Tensor logits = head != nullptr ? at::empty({rows, head->lm_head.n}, x.options()) : at::Tensor();
  auto out_of = [&](int64_t st) -> const at::Tensor& { return st < n_layers * 4 ? stage_out_[st] : logits; };

  // Per stage: the thread that claimed its serial part, in this call's generation (claims_) and
  // by id (owner); `ready` the stages whose serial part is done (all of them once one failed).
  std::vector<int> owner(n_stages, 0);
  std::atomic<int64_t> ready{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  at::Tensor h;  // the serial parts': the activations the next projection multiplies
  // The serial parts may run on any thread: give each the caller's autograd and inference modes.
  const bool inference = c10::InferenceMode::is_enabled(), grad = at::GradMode::is_enabled();

#pragma omp parallel num_threads(threads)
  {
    c10::InferenceMode inference_mode(inference);
    at::AutoGradMode grad_mode(grad);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();  // nt may be fewer than asked
    // Region r of stage st: the owner's (r = 0) or another thread's share, in chunks.
    auto region = [&](int64_t st, int r) { return share(order[st]->num_panels(), lead[st], r, nt); };
    // This thread's region in stage st once its owner is known (0 for the owner; the others
    // numbered after it).
    auto my_region = [&](int64_t st) { return (t - owner[st] + nt) % nt; };
    // This thread's region of stage `st` into its caches while the serial part of stage `now`
    // is not done, up to `budget` bytes; returns the budget left. The owner is not known yet:
    // with two threads the other one's region is 1 whoever owns it; with more, a guess.
    auto warm = [&](int64_t st, int64_t now, int64_t budget) {
      const Projection& p = *order[st];
      const auto [b, e] = region(st, std::max(t, 1));
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
    auto claim = [&](int64_t st) {
      std::atomic<uint32_t>& c = claims_[st];
      for (uint32_t seen = c.load(std::memory_order_relaxed); seen != gen;)
        if (c.compare_exchange_weak(seen, gen, std::memory_order_acq_rel)) return true;
      return false;
    };
    // Stage `st`: thread 0 (every chunk of the last stage done: it computed or saw each) runs
    // `serial` (which leaves h) and quantizes h, while the others load their region of its
    // projection, then of the next one; if thread 0 has not come after a grace period, one of
    // them runs it. Then each computes its region upwards, flagging each chunk, and then the
    // chunks of every other region not flagged yet, from the top down: a thread that lost its
    // core holds up nothing but a serial part it was running. False once the step has failed.
    auto run_stage = [&](int64_t st, auto&& serial) {
      const Projection& p = *order[st];
      const int64_t k = p.k();
      float* y = out_of(st).data_ptr<float>();
      std::atomic<uint32_t>* flag = flags_.get() + flag_at[st];
      auto compute = [&](int64_t b, int64_t e) {
        p.panels(p.codes.data_ptr(), p.scales.data_ptr(), p.n, k, q_.data(), d_.data(), s_.data(), sum_.data(), y,
                 rows, b, e);
      };
      bool mine = t == 0 && claim(st);  // thread 0's by default: the caches' layout assumes it
      if (!mine) {  // warm up, then wait for the serial part; take it if thread 0 does not come
        const int64_t budget = warm(st, st, kLoadAheadBudget);
        if (st + 1 < n_stages) warm(st + 1, st, budget);
        const auto give_up = Clock::now() + std::chrono::microseconds(kOwnerGraceMicros);
        for (int64_t spins = 0; ready.load(std::memory_order_acquire) <= st;) {
          if (spins % 64 == 0 && claims_[st].load(std::memory_order_acquire) != gen && Clock::now() > give_up &&
              claim(st)) {
            mine = true;
            break;
          }
          relax(spins);
        }
      }
      if (mine) {
        try {
          serial();
          TORCH_CHECK(h.is_contiguous() && h.size(0) == rows && h.size(1) == k, "activations [rows, ", k, "]");
          quantize_(h.data_ptr<float>(), rows, k, q_.data(), d_.data(), s_.data(), sum_.data());
        } catch (...) {
          error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
          ready.store(n_stages + 1, std::memory_order_release);  // nobody waits for a stage any more
          return false;
        }
        owner[st] = t;
        ready.store(st + 1, std::memory_order_release);
      } else if (failed.load(std::memory_order_relaxed)) {
        return false;
      }
      const int mine_r = my_region(st);
      const auto [b, e] = region(st, mine_r);
      for (int64_t c = b; c < e; c += kChunkPanels) {  // upwards, flagging each chunk after it
        if (flag[c].load(std::memory_order_acquire) == gen) continue;  // another thread took it
        if (t == stall_thread_ && stall_every_ > 0 && st % stall_every_ == 0 && c == b)
          std::this_thread::sleep_for(std::chrono::microseconds(stall_us_));
        compute(c, std::min(e, c + kChunkPanels));
        flag[c].store(gen, std::memory_order_release);
      }
      bool helped = false;  // whether another region was not done when this one was
      for (int r = 0; r < nt; ++r) {
        const auto [rb, re] = region(st, r);
        if (r == mine_r || rb >= re) continue;
        for (int64_t c = rb + (re - rb - 1) / kChunkPanels * kChunkPanels; c >= rb; c -= kChunkPanels) {
          if (flag[c].load(std::memory_order_acquire) == gen) continue;  // done (below: all, unless helped)
          compute(c, std::min(re, c + kChunkPanels));
          flag[c].store(gen, std::memory_order_release);
          helped = true;
          helped_chunks_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      if (mine && nt > 1) {  // the owner's region: a panel more if it helped, one less if not
        int64_t& learnt = lead_[st];
        if (helped && learnt < p.num_panels()) ++learnt;
        else if (!helped && learnt > 0) --learnt;
      }
      return true;
    };

    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& l = layers[i];
      const bool ok = run_stage(4 * i, [&] {
        if (i > 0) x.add_(out_of(4 * i - 1));  // the previous layer's MLP output into the residual stream
        h = rms_norm(x, l.input_norm, s.eps);
      }) && run_stage(4 * i + 1, [&] {
        h = attend(l, s, i, out_of(4 * i), cos, sin, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens,
                   scale).view({rows, s.heads * s.head_dim});
      }) && run_stage(4 * i + 2, [&] {
        h = add_rms_norm(x, out_of(4 * i + 1), l.post_norm, s.eps);
      }) && run_stage(4 * i + 3, [&] { h = silu_mul(out_of(4 * i + 2)); });
      if (!ok) break;
    }
    if (head != nullptr && !failed.load(std::memory_order_relaxed))
      run_stage(n_stages - 1, [&] {
        x.add_(out_of(n_stages - 2));
        h = rms_norm(x, head->norm, s.eps);
      });
  }
  if (error) std::rethrow_exception(error);
  ++steps_;
  if (head != nullptr) return logits;
  x.add_(out_of(n_stages - 1));
  return x;
}
