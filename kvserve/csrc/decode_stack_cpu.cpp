// A pure-decode step's decoder layers in one C++ call (issue 16: per-step overhead).
//
// At one decoding row the Python around each layer's kernels (module dispatch, slicing, the
// attention backend's checks: ~35 us a layer, ~1 ms a token on the default model) costs about
// a sixth of the token. Here the same kernels run in the same order on the same tensors, so
// the result is bit for bit the Python fused path's (tests/test_decode_stack.py); only the
// interpreter between them is gone. The projections are the native int4 / int8 matmuls of a
// quant_kernels variant module, reached through the function pointers it exports (both modules
// are built against the same torch headers); the small ops and the attention are this
// extension's own.
#include "decode_stack.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <optional>
#include <vector>

at::Tensor attend(const Layer& l, const StackShape& s, int64_t i, const at::Tensor& qkv, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                  const at::Tensor& slot_offsets, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  double scale) {
  const int64_t rows = qkv.size(0), nd = seq_lens.numel(), q_size = s.heads * s.head_dim,
                kv_size = s.kv_heads * s.head_dim;
  at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, s.heads, s.head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, s.kv_heads, s.head_dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, s.kv_heads, s.head_dim});
  rotary_inplace(q, cos, sin);
  rotary_inplace(k, cos, sin);
  at::Tensor kc = kv_cache.select(0, i).select(0, 0), vc = kv_cache.select(0, i).select(0, 1);
  if (l.coded_cache) kv_write_codes(kc, vc, l.k_scales, l.v_scales, k, v, slot_blocks, slot_offsets, false);
  else kv_write(kc, vc, k, v, slot_blocks, slot_offsets);
  const at::Tensor &ks = l.k_scales, &vs = l.v_scales;  // empty for a float cache, as the kernel takes it
  if (nd == rows) return paged_decode_attention(q.contiguous(), kc, vc, ks, vs, block_tables, seq_lens, scale);
  at::Tensor attn = at::zeros({rows, s.heads, s.head_dim}, qkv.options());
  attn.narrow(0, 0, nd).copy_(
      paged_decode_attention(q.narrow(0, 0, nd).contiguous(), kc, vc, ks, vs, block_tables, seq_lens, scale));
  return attn;
}

namespace {

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps) : shape_{heads, kv_heads, head_dim, eps} {}

  // One layer, in order. fns: the four projections' matmuls as addresses (qkv, o, gate_up,
  // down); weights: their (codes, scales) pairs in the same order; ns: their output rows;
  // panel_fns: their panel-range forms (or empty) and quantize the module's activation
  // quantizer (or 0), which the overlapped path needs; biases: their biases (float32 [n], or
  // empty for none: Qwen2's qkv, Llama's attention_bias and mlp_bias).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<int64_t> fns,
                 std::vector<at::Tensor> weights, std::vector<int64_t> ns, at::Tensor k_scales, at::Tensor v_scales,
                 std::vector<int64_t> panel_fns, int64_t quantize, std::vector<at::Tensor> biases) {
    TORCH_CHECK(fns.size() == 4 && weights.size() == 8 && ns.size() == 4 && biases.size() == 4, "four projections");
    TORCH_CHECK(panel_fns.empty() || panel_fns.size() == 4, "four panel-range forms, or none");
    Projection p[4];
    for (int i = 0; i < 4; ++i) {
      PanelsFn panels = panel_fns.empty() ? nullptr : reinterpret_cast<PanelsFn>(panel_fns[i]);
      const at::Tensor& b = biases[i];
      TORCH_CHECK(b.numel() == 0 || (b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == ns[i]),
                  "a bias: contiguous float32 [out_features]");
      p[i] = {reinterpret_cast<MatmulFn>(fns[i]), panels, weights[2 * i], weights[2 * i + 1], ns[i],
              b.numel() > 0 ? b : at::Tensor()};
    }
    const bool coded_cache = k_scales.numel() > 0;
    layers_.push_back({input_norm, post_norm, k_scales, v_scales, p[0], p[1], p[2], p[3], coded_cache});
    const QuantizeFn q = reinterpret_cast<QuantizeFn>(quantize);
    const bool before = layers_.size() == 1 || overlap_usable_;
    overlap_usable_ = before && overlapped_.accepts(layers_.front(), layers_.back(), q);
  }

  // The final norm and the lm_head, for forward_logits: the lm_head's matmul address, weights
  // and rows, its panel-range form (or 0) and activation quantizer (or 0).
  void set_head(at::Tensor norm, int64_t fn, at::Tensor codes, at::Tensor scales, int64_t n, int64_t panels,
                int64_t quantize) {
    head_ = Head{norm, {reinterpret_cast<MatmulFn>(fn), reinterpret_cast<PanelsFn>(panels), codes, scales, n}};
    head_overlapped_ = overlap_usable_ && overlapped_.accepts(head_->lm_head, reinterpret_cast<QuantizeFn>(quantize));
  }
  bool has_head() const { return head_.has_value(); }
  bool head_overlapped() const { return head_overlapped_; }

  // Steps of up to this many rows run the overlapped path (0: never).
  void set_overlap_rows(int64_t rows) { overlap_rows_ = rows; }
  // Overlapped steps of at least this many rows share thread 0's serial work by rows (0: never).
  void set_split_rows(int64_t rows) { overlapped_.set_split_rows(rows); }
  bool overlap_usable() const { return overlap_usable_; }
  int64_t overlapped_steps() const { return overlapped_.steps(); }
  int64_t overlapped_helped_items() const { return overlapped_.helped_items(); }

  // x: the residual stream [rows, hidden] float32 (added into in place and returned); cos/sin
  // [rows, head_dim]; kv_cache [layers, 2, blocks, kv_heads, block_size, head_dim]; the slots of
  // the first len(slot_blocks) rows and the block tables / lengths of the first
  // len(seq_lens) rows, every one a decode (rows past them pad the batch: computed, never
  // stored, attention output zero).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slot_blocks,
                     at::Tensor slot_offsets, at::Tensor block_tables, at::Tensor seq_lens, double scale) {
    return run(x, false, cos, sin, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens, scale);
  }

  // forward, then the final norm and the lm_head (set_head): the step's logits [rows, vocab].
  at::Tensor forward_logits(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache,
                            at::Tensor slot_blocks, at::Tensor slot_offsets, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale) {
    TORCH_CHECK(head_.has_value(), "forward_logits: no head set");
    return run(x, true, cos, sin, kv_cache, slot_blocks, slot_offsets, block_tables, seq_lens, scale);
  }

 private:
  at::Tensor run(at::Tensor x, bool logits, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                 const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, double scale) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 rows");
    TORCH_CHECK(kv_cache.size(0) == static_cast<int64_t>(layers_.size()), "one KV cache per layer");
    const int64_t rows = x.size(0);
    const Head* head = logits ? &*head_ : nullptr;
    if (overlap_usable_ && rows <= overlap_rows_ && at::get_num_threads() > 1 &&
        !at::in_parallel_region()) {
      const bool inside = head != nullptr && head_overlapped_;  // the head as the region's last stage
      x = overlapped_.forward(layers_, inside ? head : nullptr, shape_, x, cos, sin, kv_cache, slot_blocks,
                              slot_offsets, block_tables, seq_lens, scale);
      if (inside || head == nullptr) return x;
    } else {
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& l = layers_[i];
        at::Tensor qkv = l.qkv(rms_norm(x, l.input_norm, shape_.eps));
        at::Tensor attn = attend(l, shape_, i, qkv, cos, sin, kv_cache, slot_blocks, slot_offsets, block_tables,
                                 seq_lens, scale);
        at::Tensor h =
            add_rms_norm(x, l.o(attn.view({rows, shape_.heads * shape_.head_dim})), l.post_norm, shape_.eps);
        x.add_(l.down(silu_mul(l.gate_up(h))));
      }
      if (head == nullptr) return x;
    }
    return head->lm_head(rms_norm(x, head->norm, shape_.eps));
  }

  StackShape shape_;
  std::vector<Layer> layers_;
  OverlappedStack overlapped_;
  bool overlap_usable_ = false;
  int64_t overlap_rows_ = 0;
  std::optional<Head> head_;
  bool head_overlapped_ = false;  // the head's lm_head runs as the overlapped region's last stage
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "A pure-decode step's decoder layers in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_overlap_rows", &DecodeStack::set_overlap_rows)
      .def("set_split_rows", &DecodeStack::set_split_rows)
      .def("overlap_usable", &DecodeStack::overlap_usable)
      .def("overlapped_steps", &DecodeStack::overlapped_steps)
      .def("overlapped_helped_items", &DecodeStack::overlapped_helped_items)
      .def("set_head", &DecodeStack::set_head)
      .def("has_head", &DecodeStack::has_head)
      .def("head_overlapped", &DecodeStack::head_overlapped)
      .def("forward", &DecodeStack::forward)
      .def("forward_logits", &DecodeStack::forward_logits);
}
