"""Weight quantization formats, in their plain (unpacked) form.

A `QWeight` is what the loader produces and `QuantizedLinear` packs for a kernel:
- int8: symmetric per-output-channel, `w = q * scale` (q in [-127, 127]);
- int4: group-wise with scale and zero point over groups of 32 inputs,
  `w = (q - 8) * scale + zero` (q in [0, 15]), the convention of PyTorch's int4 kernels;
- fp8: e4m3 with a per-output-channel scale, `w = q * scale`.

Scales and zero points are rounded to bfloat16 before the codes are chosen, because the CPU
kernels take them in bfloat16: the codes then fit the scales the kernel really uses.
Rows are output channels, so fusing q/k/v or gate/up is a row concatenation of codes and
scales, and llama.cpp's rotary row permutation applies to them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

INT4_GROUP_SIZE = 32
SCALE_DTYPE = torch.bfloat16
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class QWeight:
    """A quantized [out_features, in_features] matrix before packing."""

    method: str
    codes: torch.Tensor  # int8 [N, K] | uint8 [N, K] in 0..15 | float8_e4m3fn [N, K]
    scales: torch.Tensor  # SCALE_DTYPE: [N] (int8, fp8) or [N, K / group] (int4)
    zeros: torch.Tensor | None = None  # SCALE_DTYPE [N, K / group], int4 only
    group_size: int = 0  # int4 only

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.method == "int4":
            n, k = self.codes.shape
            q = self.codes.view(n, k // self.group_size, self.group_size).float() - 8
            w = q * self.scales.float().unsqueeze(-1) + self.zeros.float().unsqueeze(-1)
            return w.reshape(n, k).to(dtype)
        return (self.codes.float() * self.scales.float().unsqueeze(1)).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QWeight:
        """Apply a row (output channel) permutation or selection to codes and scales alike."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return QWeight(self.method, fn(self.codes), fn(self.scales), zeros, self.group_size)


def quantize_weight(w: torch.Tensor, method: str) -> QWeight:
    """Quantize a float [N, K] weight (round to nearest)."""
    w = w.detach().float()
    if method == "int4":
        return _quantize_int4(w)
    qmax = 127.0 if method == "int8" else FP8_MAX
    scales = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12).to(SCALE_DTYPE)
    q = (w / scales.float().unsqueeze(1)).clamp(-qmax, qmax)
    codes = q.round().to(torch.int8) if method == "int8" else q.to(torch.float8_e4m3fn)
    return QWeight(method, codes, scales)


def _quantize_int4(w: torch.Tensor, group: int = INT4_GROUP_SIZE) -> QWeight:
    n, k = w.shape
    if k % group:
        raise ValueError(f"quantization: int4 needs in_features divisible by {group}, got {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12).to(SCALE_DTYPE)
    zeros = (lo + 8 * scales.float()).to(SCALE_DTYPE)
    s, z = scales.float().unsqueeze(-1), zeros.float().unsqueeze(-1)
    codes = ((g - z) / s + 8).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return QWeight("int4", codes, scales, zeros, group)


def fuse(parts: Sequence[torch.Tensor | QWeight], method: str | None) -> torch.Tensor | QWeight:
    """Concatenate projections along their outputs (q|k|v, gate|up), quantizing if asked.

    Parts already in the target format (loaded directly from a GGUF) are concatenated as
    they are; anything else goes through float once.
    """
    if method is None:
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    if all(isinstance(p, QWeight) and p.method == method for p in parts):
        groups = {p.group_size for p in parts}
        if len(groups) == 1:
            zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
            return QWeight(
                method, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                parts[0].group_size,
            )  # fmt: skip
    floats = [p.dequantize() if isinstance(p, QWeight) else p for p in parts]
    return quantize_weight(torch.cat(floats), method)
