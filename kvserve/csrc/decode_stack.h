// The decode stack's layers as its two forward paths read them (decode_stack_cpu.cpp: one
// parallel region per kernel; decode_overlap_cpu.cpp: the whole stack in one region, the weight
// stream overlapping the serial work).
#pragma once
#include "cpu_kernels.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <vector>

// The signatures of quant_matmul_cpu.cpp's entry points, reached by address (its module is built
// per instruction set, against the same torch headers):
//   int4_mm / int8_mm: y = x @ W.T for the rows of x;
using MatmulFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
//   int4_panel_range / int8_panel_range: output panels [p0, p1) of 16 rows for M quantized rows;
using PanelsFn = void (*)(const void* codes, const void* scales, int64_t n, int64_t k, const int8_t* q,
                          const float* d, const float* s, const int32_t* sum, float* y, int64_t m, int64_t p0,
                          int64_t p1);
//   quantize_rows_into: the activations both kernels multiply, per row and group of 32.
using QuantizeFn = void (*)(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* s, int32_t* sum);

struct Projection {
  MatmulFn fn;
  PanelsFn panels;  // null where the module has no panel-range form
  at::Tensor codes, scales;
  int64_t n;
  at::Tensor bias;  // float32 [n], or undefined: added to each row after the matmul, as Python's y + bias
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = fn(x, codes, scales, n);
    return bias.defined() ? y.add_(bias) : y;
  }
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  int64_t num_panels() const { return codes.size(0); }
  int64_t k() const { return codes.size(1) * (codes.scalar_type() == at::kByte ? 8 : 4); }  // int4: 2 a byte
  int64_t codes_per_panel() const { return codes.size(1) * codes.size(2); }  // bytes
  int64_t scales_per_panel() const { return scales.nbytes() / codes.size(0); }  // bytes
};

struct Layer {
  at::Tensor input_norm, post_norm, k_scales, v_scales;  // scales: empty unless the cache is 1-byte codes
  Projection qkv, o, gate_up, down;
  bool coded_cache;  // int8 or float8_e4m3fn codes with their scales
  // The j-th projection in the order a layer runs them.
  const Projection& projection(int j) const { return j == 0 ? qkv : j == 1 ? o : j == 2 ? gate_up : down; }
};

// The final norm and the lm_head, where the stack computes a decode step's logits too
// (DecodeStack.forward_logits): the step's last stage, so the overlapped path's region runs it
// with its learnt split instead of a region of its own after the Python between them.
struct Head {
  at::Tensor norm;
  Projection lm_head;
};

struct StackShape {
  int64_t heads, kv_heads, head_dim;
  double eps;
};

// Layer l's attention in a pure-decode step (its KV cache: kv_cache[i]): q and k of the qkv
// projection's output rotated, K/V stored at the rows' slots, the output [rows, heads,
// head_dim]; rows past len(seq_lens) pad the batch and get zeros. Both paths call it.
at::Tensor attend(const Layer& l, const StackShape& s, int64_t i, const at::Tensor& qkv, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                  const at::Tensor& slot_offsets, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  double scale);

// The whole stack in one parallel region for a few rows (decode_overlap_cpu.cpp).
class OverlappedStack {
 public:
  // Whether layer l, added after `first` (or being it), can run here: its projections have
  // panel-range forms from the module whose activation quantizer is `quantize`, the same for
  // every layer, and its shapes are the first's. Else forward must not be called.
  bool accepts(const Layer& first, const Layer& l, QuantizeFn quantize);
  // Whether the head's lm_head can run here as the last stage (the same conditions).
  bool accepts(const Projection& lm_head, QuantizeFn quantize);
  // The residual stream after the layers, or, given an accepted head, the logits.
  at::Tensor forward(const std::vector<Layer>& layers, const Head* head, const StackShape& s, at::Tensor x,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                     const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale);
  int64_t steps() const { return steps_; }  // forward calls so far
  // Steps of at least this many rows share each stage's serial part by rows (0: never).
  void set_split_rows(int64_t rows) { split_rows_ = rows; }
  // attention items the workers computed so far (the rest were thread 0's)
  int64_t helped_items() const { return helped_.load(std::memory_order_relaxed); }

 private:
  // What each stage's projection reads and each layer's serial work needs, as raw pointers: the
  // region touches no tensor. Built (and checked) on the first forward for these layers and this
  // head (its lm_head's codes, or null).
  struct Stage {
    PanelsFn panels;
    const char *codes, *scales;
    int64_t n, k, num_panels, codes_bytes, scales_bytes;  // the last two: per panel
  };
  struct LayerPtrs {
    const float *input_norm, *post_norm;
    at::BFloat16 *k_scales, *v_scales;  // null for a float cache
    const float* bias[4];               // per projection (qkv, o, gate_up, down), null for none
  };
  void prepare(const std::vector<Layer>& layers, const Head* head, const StackShape& s, int64_t hidden);
  std::vector<Stage> stages_;
  std::vector<LayerPtrs> layer_ptrs_;
  const void* prepared_head_ = nullptr;
  size_t prepared_layers_ = 0;
  int64_t steps_ = 0;
  int64_t split_rows_ = 0;
  std::atomic<int64_t> helped_{0};
  QuantizeFn quantize_ = nullptr;
  // Whether p has a panel-range form from the module of `quantize` (and its panels' layout).
  bool has_panels(const Projection& p, QuantizeFn quantize);
  // per row count, per stage (4 a layer, then the head's): the panels the serial thread computes
  std::map<int64_t, std::vector<int64_t>> leads_;
  std::vector<int8_t> q_;      // the activations of the projection about to run, quantized
  std::vector<float> d_, s_;
  std::vector<int32_t> sum_;
  std::vector<float> normed_, attn_, act_;  // thread 0's activations between the stages
  std::vector<float> out_[4];                 // the four projections' outputs
};
