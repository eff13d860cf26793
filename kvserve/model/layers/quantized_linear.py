"""One quantized projection: packs a `QWeight` for the fastest kernel on its device, per row count.

CPU (measured on AVX-512 + AMX, benchmarks/bench_quant_kernels.py; the batched paths and why
they were chosen are in layers/quant_batched.py):
- int4 (group 32) and int8 (in_features % 32 == 0) -> kvserve's native C++ kernels
  (csrc/quant_matmul_cpu.cpp, the variant for this CPU's ISA, layers/quant_kernels.py) at
  every row count: weights in 16-row panels, activations quantized to int8 per group of 32,
  integer dot products (AVX-512 VNNI `vpdpbusd` / AVX2 `vpmaddubsw`). A row's result is the
  same bit for bit alone, in a batch or in a prefill chunk.
- Where they cannot be built: int4 -> `aten._weight_int4pack_mm_for_cpu` (bf16 activations)
  at every row count (the dynamic int8 path on an int8 copy, `INT4_DYNAMIC_MIN_ROWS`, is off:
  slower end to end); int8 -> `aten._weight_int8pack_mm` with bf16 activations (with float32
  ones PyTorch takes a scalar path 6-40x slower) below `bf16_min_rows` rows, from there the
  codes can be widened to bf16 per call for oneDNN's bf16 matmul (only with native bf16; off
  for now, see `INT8_BF16_MIN_ROWS`).
- fp8 -> dequantizing path: the e4m3 codes are widened to bfloat16 (exact) for a bfloat16
  matmul and the per-channel scale is applied to the output. There is no fp8 weight-only
  matmul on CPU; `torch._scaled_mm` works there but also quantizes the activations.
CUDA: fp8 uses `torch._scaled_mm` (row-wise scales) on compute capability >= 8.9 (Ada,
Hopper); int8/int4 and older GPUs dequantize (correct, not fast; untested on hardware).

The int8 and fp8 formats also serve embedding lookups (one row per token), so a tied
embedding / lm_head is stored once.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn

from kvserve.model.layers import quant_kernels
from kvserve.model.layers.linear import linear
from kvserve.model.layers.quant_batched import (
    INT4_DYNAMIC_MIN_ROWS,
    INT8_BF16_MIN_ROWS,
    INT8_BF16_MIN_ROWS_LARGE,
    LARGE_WEIGHT,
    dynamic_int8_mm,
    dynamic_int8_pack,
    int8_bf16_mm,
)
from kvserve.model.layers.quantization import SCALE_DTYPE, QWeight, quantize_weight
from kvserve.platform.cpu_isa import cpu_isa

COMPUTE_DTYPE = torch.bfloat16  # activations inside quantized projections


class NativeMatmul(NamedTuple):
    """A projection on the native kernels as C++ callers (the decode stack) take it: addresses
    in its quant_kernels module, and its weights."""

    address: int  # int4_mm / int8_mm
    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    panels: int  # int4_panel_range / int8_panel_range, 0 where the module has none
    quantize: int  # the module's activation quantizer, 0 where it has none


def _cuda_fp8_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) for a quantized W; parameters are buffers so they count as weights."""

    def __init__(self, qw: QWeight, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.method = qw.method
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        cpu = torch.device(device).type == "cpu"
        # Packed for aten's CPU kernels (its int4 one needs out_features divisible by 16).
        self.kernel = cpu and (qw.method != "int4" or qw.shape[0] % 16 == 0)
        self.use_scaled_mm = qw.method == "fp8" and _cuda_fp8_ok(torch.device(device))
        # The dynamic int8 kernel's packed weight, and the row count from which it runs.
        self.dynamic, self.dynamic_min_rows = None, 1
        # int8: from this many rows, codes widened to bf16 per call (quant_batched.int8_bf16_mm).
        large = qw.shape[0] * qw.shape[1] > LARGE_WEIGHT
        widen_from = INT8_BF16_MIN_ROWS_LARGE if large else INT8_BF16_MIN_ROWS
        # Without native bf16 a bf16 matmul is slower than the int8 kernel; off: see quant_batched.
        self.bf16_min_rows = widen_from if widen_from is not None and cpu_isa().native_bf16 else sys.maxsize
        # int4 (groups of 32) and int8: kvserve's own kernel (int4 held in its layout only).
        # The variant's name, not the module: layers are pickled to tensor-parallel workers.
        self.native: str | None = None
        native_ok = (qw.method == "int4" and qw.group_size == 32) or (
            qw.method == "int8" and qw.shape[1] % 32 == 0
        )
        if cpu and native_ok and quant_kernels.load_quant_kernels():
            self.native = quant_kernels.selected_variant()
            self.kernel = False
        if self.kernel and qw.method == "int4" and INT4_DYNAMIC_MIN_ROWS is not None:
            q8 = quantize_weight(qw.dequantize(), "int8")
            self.dynamic = dynamic_int8_pack(q8.codes, q8.scales)
            self.dynamic_min_rows = INT4_DYNAMIC_MIN_ROWS
        if self.native is not None and qw.method == "int4":
            packed, sz = quant_kernels.pack_int4(qw.codes, qw.scales, qw.zeros)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales_zeros", sz)  # [P, K / 32, 2, 16]: see pack_int4
        elif qw.method == "int4":
            if self.kernel:
                packed = torch._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32), 1)
            else:  # two codes per byte, low nibble first; dequantized per call
                packed = qw.codes[:, 0::2] | (qw.codes[:, 1::2] << 4)
            self.register_buffer("qweight", packed)
            # [K / group, N, 2]: the kernels' scales-and-zeros layout.
            self.register_buffer("scales_zeros", torch.stack([qw.scales.t(), qw.zeros.t()], -1).contiguous())
        elif self.native is not None:  # int8 in the kernel's panels
            packed, scales = quant_kernels.pack_int8(qw.codes, qw.scales.to(SCALE_DTYPE))
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scales)  # [P * 16]: zero past out_features
        else:
            self.register_buffer("qweight", qw.codes.contiguous())
            self.register_buffer("scales", qw.scales.to(SCALE_DTYPE))

    def dynamic_bytes(self) -> int:
        """Bytes of the dynamic kernel's packed weight (not a buffer): codes + float scales."""
        return 0 if self.dynamic is None else self.out_features * (self.in_features + 4)

    def duplicate_bytes(self) -> int:
        """Bytes of a second copy of this weight: the dynamic kernel's int8 one (int4 only)."""
        return self.dynamic_bytes()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.native is not None and bias is None and x.dim() == 2 and x.dtype == torch.float32:
            return self._native_2d(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.native is not None:
            y = self._native_2d(x2.float())
        elif self.dynamic is not None and x2.shape[0] >= self.dynamic_min_rows:
            y = dynamic_int8_mm(x2, self.dynamic)
        elif self.method == "int8" and self.kernel and x2.shape[0] >= self.bf16_min_rows:
            y = int8_bf16_mm(x2, self.qweight, self.scales)
        elif self.method == "int8" and self.kernel:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(COMPUTE_DTYPE), self.qweight, self.scales)
        elif self.method == "int4" and self.kernel:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(COMPUTE_DTYPE), self.qweight, self.group_size, self.scales_zeros
            )
        elif self.use_scaled_mm:
            y = self._scaled_mm(x2)
        elif self.method == "fp8":  # `linear`: bf16 rows in runs that give each row the same bits
            y = linear(x2.to(COMPUTE_DTYPE), self.qweight.to(COMPUTE_DTYPE), None, None)
            y = y.float() * self.scales.float()
        else:
            y = linear(x2.to(COMPUTE_DTYPE), self.dequantize(COMPUTE_DTYPE), None, None)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y if bias is None else y + bias

    def _native_2d(self, x: torch.Tensor) -> torch.Tensor:
        """The native kernels on float32 rows, the decode hot path: per call it costs about
        what a one-row matmul does, so buffers are read from `_buffers` directly (nn.Module's
        attribute fallback is a slow path) and no no-op reshapes or casts are dispatched."""
        buffers, kernels = self._buffers, quant_kernels.kernels_for(self.native)
        x = x.contiguous()
        if self.method == "int8":
            return kernels.int8_mm(x, buffers["qweight"], buffers["scales"], self.out_features)
        return kernels.int4_mm(x, buffers["qweight"], buffers["scales_zeros"], self.out_features)

    def native_matmul(self) -> NativeMatmul | None:
        """This projection for C++ callers (the decode stack), or None where it does not run
        the native kernels."""
        if self.native is None:
            return None
        mod = quant_kernels.kernels_for(self.native)
        if mod is None or not hasattr(mod, "matmul_addresses"):
            return None
        scales = self._buffers["scales" if self.method == "int8" else "scales_zeros"]
        addresses = mod.matmul_addresses()
        panels, quantize = addresses.get(f"{self.method}_panels", 0), addresses.get("quantize_rows", 0)
        codes = self._buffers["qweight"]
        return NativeMatmul(addresses[self.method], codes, scales, self.out_features, panels, quantize)

    def kernel_name(self) -> str:
        """What runs this projection (for the start-up log)."""
        if self.native is not None and self.method == "int8":
            return f"int8: kvserve native C++ ({self.native}), 16-row panels x int8 activations"
        if self.native is not None:
            name = f"int4: kvserve native C++ ({self.native}), 16-row panels x int8 activations"
            tiles = quant_kernels.INT4_TILES.get(self.native)  # the AVX2 tiles' form, chosen at load
            return f"{name}, {tiles}" if tiles else name
        dyn = "quantized::linear_dynamic (int8 x dynamic u8 activations)"
        if self.dynamic is not None:
            return (f"int4: aten._weight_int4pack_mm_for_cpu below {self.dynamic_min_rows} rows, "
                    f"then {dyn} on an int8 copy")  # fmt: skip
        if self.method == "int8" and self.kernel:
            return (f"int8: aten._weight_int8pack_mm (bf16 activations) below {self.bf16_min_rows} rows, "
                    "then codes widened to bf16 per call + oneDNN bf16 matmul")  # fmt: skip
        if self.method == "int4" and self.kernel:
            return "int4: aten._weight_int4pack_mm_for_cpu (bf16 activations)"
        if self.use_scaled_mm:
            return "fp8: torch._scaled_mm (row-wise scales)"
        return f"{self.method}: dequantize to bf16 per call + F.linear"

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """fp8 x fp8 with row-wise scales (activations quantized per token, dynamically)."""
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=1e-12)
        xq = (x.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scales.float().view(1, -1),
            out_dtype=torch.bfloat16,
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [N, K] weight (for the generic path and for tests)."""
        if self.native is not None and self.method == "int4":
            return quant_kernels.unpack_int4(self.qweight, self.scales_zeros, self.out_features, dtype)
        if self.method != "int4":
            return self.embedding(torch.arange(self.out_features, device=self.qweight.device), dtype)
        if self.kernel:  # run the kernel on the identity: rows of I @ W.T are W's columns
            eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE, device=self.qweight.device)
            w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.qweight, self.group_size, self.scales_zeros
            )
            return w_t.t().to(dtype)
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = torch.stack([self.qweight & 15, self.qweight >> 4], -1).view(n, k // g, g).float() - 8
        sz = self.scales_zeros.float()
        w = codes * sz[..., 0].t().unsqueeze(-1) + sz[..., 1].t().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W, dequantized: the embedding lookup of a tied (or int8) table."""
        if self.method == "int4":
            raise ValueError("quantization: int4 tables cannot serve embedding lookups")
        if self.native is not None:
            if dtype == torch.float32:  # one call: the decode hot path
                kernels = quant_kernels.kernels_for(self.native)
                return kernels.int8_embedding(self._buffers["qweight"], self._buffers["scales"], ids)
            rows = quant_kernels.int8_rows(self.qweight, ids).to(torch.float32)
        else:
            rows = self.qweight.index_select(0, ids).to(torch.float32)
        return (rows * self.scales.index_select(0, ids).float().unsqueeze(1)).to(dtype)
