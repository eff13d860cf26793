// The Python module of kvserve's CPU kernels: one extension built from the sources beside this
// file (model/layers/cpu_kernels.py lists them), so they load, cache and fall back together.
#include "cpu_kernels.h"

void bind_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) (float32 or bfloat16)");
  m.def("rotary_inplace", &rotary_inplace, "Rotate-half rotary embedding in place (float32 or bfloat16)");
  m.def("kv_write", &kv_write, "Store K/V rows at their slots");
  m.def("kv_write_codes", &kv_write_codes,
        "Quantize K/V rows to the cache's int8 or float8_e4m3fn codes (a bfloat16 scale per head vector) at their slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate|up row (float32 or bfloat16)");
  m.def("row_argmax", &row_argmax, "Index of each float32 row's largest value, as torch.max(x, -1).indices");
  bind_decode_stack(m);
}
