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
#include "cpu_kernels.h"

#include <cstdint>
#include <vector>

namespace {

// quant_matmul_cpu.cpp's int4_mm / int8_mm: y = x @ W.T for N rows of packed W.
using MatmulFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);

struct Projection {
  MatmulFn fn;
  at::Tensor codes, scales;
  int64_t n;
  at::Tensor operator()(const at::Tensor& x) const { return fn(x, codes, scales, n); }
};

struct Layer {
  at::Tensor input_norm, post_norm, k_scales, v_scales;  // scales: empty unless the cache is int8
  Projection qkv, o, gate_up, down;
  bool int8_cache;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // One layer, in order. fns: the four projections' matmuls as addresses (qkv, o, gate_up,
  // down); weights: their (codes, scales) pairs in the same order; ns: their output rows.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<int64_t> fns,
                 std::vector<at::Tensor> weights, std::vector<int64_t> ns, at::Tensor k_scales, at::Tensor v_scales) {
    TORCH_CHECK(fns.size() == 4 && weights.size() == 8 && ns.size() == 4, "four projections");
    Projection p[4];
    for (int i = 0; i < 4; ++i) p[i] = {reinterpret_cast<MatmulFn>(fns[i]), weights[2 * i], weights[2 * i + 1], ns[i]};
    const bool int8_cache = k_scales.numel() > 0;
    layers_.push_back({input_norm, post_norm, k_scales, v_scales, p[0], p[1], p[2], p[3], int8_cache});
  }

  // x: the residual stream [rows, hidden] float32 (added into in place and returned); cos/sin
  // [rows, head_dim]; kv_cache [layers, 2, blocks, kv_heads, block_size, head_dim]; the slots of
  // the first len(slot_blocks) rows and the block tables / lengths of the first
  // len(seq_lens) rows, every one a decode (rows past them pad the batch: computed, never
  // stored, attention output zero).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slot_blocks,
                     at::Tensor slot_offsets, at::Tensor block_tables, at::Tensor seq_lens, double scale) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 rows");
    TORCH_CHECK(kv_cache.size(0) == static_cast<int64_t>(layers_.size()), "one KV cache per layer");
    const int64_t rows = x.size(0), nd = seq_lens.numel(), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor qkv = l.qkv(rms_norm(x, l.input_norm, eps_));
      at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads_, head_dim_});
      rotary_inplace(q, cos, sin);
      rotary_inplace(k, cos, sin);
      at::Tensor kc = kv_cache.select(0, i).select(0, 0), vc = kv_cache.select(0, i).select(0, 1);
      if (l.int8_cache) kv_write_int8(kc, vc, l.k_scales, l.v_scales, k, v, slot_blocks, slot_offsets, false);
      else kv_write(kc, vc, k, v, slot_blocks, slot_offsets);
      const at::Tensor &ks = l.k_scales, &vs = l.v_scales;  // empty for a float cache, as the kernel takes it
      at::Tensor attn;
      if (nd == rows) {
        attn = paged_decode_attention(q.contiguous(), kc, vc, ks, vs, block_tables, seq_lens, scale);
      } else {
        attn = at::zeros({rows, heads_, head_dim_}, x.options());
        attn.narrow(0, 0, nd).copy_(
            paged_decode_attention(q.narrow(0, 0, nd).contiguous(), kc, vc, ks, vs, block_tables, seq_lens, scale));
      }
      at::Tensor h = add_rms_norm(x, l.o(attn.view({rows, q_size})), l.post_norm, eps_);
      x.add_(l.down(silu_mul(l.gate_up(h))));
    }
    return x;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", "A pure-decode step's decoder layers in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
