// The Python module of kvserve's CPU kernels: one extension built from the sources beside this
// file (model/layers/cpu_kernels.py lists them), so they load, cache and fall back together.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_blocks, torch::Tensor slot_offsets);
void kv_write_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scales, torch::Tensor v_scales,
                   torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                   bool round_trip);
torch::Tensor silu_mul(torch::Tensor gate_up);

void bind_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) (float32 or bfloat16)");
  m.def("rotary_inplace", &rotary_inplace, "Rotate-half rotary embedding in place (float32 or bfloat16)");
  m.def("kv_write", &kv_write, "Store K/V rows at their slots");
  m.def("kv_write_int8", &kv_write_int8, "Quantize K/V rows to int8 (a bfloat16 scale per head vector) at their slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate|up row (float32 or bfloat16)");
  bind_decode_stack(m);
}
