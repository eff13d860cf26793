"""The decoder layer's small ops as Triton kernels, for models on a CUDA device.

Measured on an H200 (docs/BENCHMARKS.md): batch-1 decode of an 8B-shaped Llama spent 3.5 ms of
its 5.7 ms graph replay in the projections (at 97% of the copy bandwidth) and most of the rest
in ~25 small kernels a layer: RMSNorm alone is four (upcast, norm, downcast, weight), rotary
five per tensor (negate, cat, two products, sum). Each costs a launch's ~2 us at one row. Here
each op is one kernel, with the interface of the C++ CPU ops (cpu_kernels.py), so the layer's
fused forward (llama.py `_forward_fused`) runs either.

Every kernel computes in float32 and rounds where the torch reference rounds (to the model
dtype after each product and sum of rotary, after the normalisation before the weight, after
SiLU before the product), so a bfloat16 model gets the bits the eager path would give up to
float32 summation order. Float32 and bfloat16 only: the activations the fused path takes.
Under TRITON_INTERPRET=1 they run on the CPU (tests/test_triton_layer_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels import next_pow2
from kvserve.attention_backends.triton_kernels.rounding import round_to_bf16

NO_ROUNDING, BF16 = 0, 1  # how a kernel rounds its float32 steps: as the model dtype would
DTYPES = (torch.float32, torch.bfloat16)  # the layers' fused path takes no other (llama.FUSED_DTYPES)


def rounding(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"the Triton layer ops take float32 or bfloat16 activations, not {dtype}")
    return BF16 if dtype == torch.bfloat16 else NO_ROUNDING


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """float32 x rounded to the nearest bfloat16 (ties to even) where ROUND says so, kept as
    float32; by hand, as Triton's interpreter would truncate, and the compiler cannot fuse a
    product into the sum that follows (which would skip the product's rounding)."""
    if ROUND == 1:
        x = round_to_bf16(x)
    return x


@triton.jit
def _rms_norm_kernel(X, Y, W, OUT, stride_x, stride_y, stride_out, n_cols, eps,
                     ADD: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual stream takes the sublayer's output first (in place, rounded)
        r = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x + r, ROUND)
        tl.store(X + row * stride_x + cols, x.to(X.dtype.element_ty), mask=mask)
    y = _rounded(x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps), ROUND)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, _rounded(y * w, ROUND).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(T, COS, SIN, stride_row, stride_head, stride_cs,
                   HALF: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    base = T + row * stride_row + head * stride_head
    x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    cs = row * stride_cs + d
    c1 = tl.load(COS + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    a1, b1 = _rounded(x1 * c1, ROUND), _rounded(-x2 * s1, ROUND)
    a2, b2 = _rounded(x2 * c2, ROUND), _rounded(x1 * s2, ROUND)
    tl.store(base + d, _rounded(a1 + b1, ROUND).to(T.dtype.element_ty), mask=mask)
    tl.store(base + HALF + d, _rounded(a2 + b2, ROUND).to(T.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n_cols, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = _rounded(g / (1.0 + tl.exp(-g)), ROUND)
    tl.store(OUT + row * stride_out + cols, _rounded(s * u, ROUND).to(OUT.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels step over rows by stride and read each row's elements one after another."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"expected rows of contiguous elements, got shape {tuple(t.shape)}, strides {t.stride()}"
        )
    return t


class TritonLayerOps:
    """rms_norm, add_rms_norm, rotary_inplace and silu_mul: the CPU ops' interface on the GPU."""

    SILU_BLOCK = 1024

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._norm(_rows(x), x, weight, out, eps, add=False)
        return out

    def add_rms_norm(self, x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x += o in place (the residual stream), then RMSNorm(x) * w."""
        if o.shape != x.shape:
            raise ValueError(f"add_rms_norm: the output {tuple(o.shape)} does not match x {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._norm(_rows(x), _rows(o), w, out, eps, add=True)
        return out

    @staticmethod
    def _norm(x, y, weight, out, eps: float, add: bool) -> None:
        n, h = x.shape
        if n:
            _rms_norm_kernel[(n,)](x, y, weight, out, x.stride(0), y.stride(0), out.stride(0), h, eps,
                                   ADD=add, ROUND=rounding(x.dtype), BLOCK=next_pow2(h),
                                   num_warps=8 if h >= 2048 else 4)  # fmt: skip

    def rotary_inplace(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """t [tokens, heads, head_dim] (a view of the qkv output) rotated in place by the
        step's cos / sin tables ([tokens, 1, head_dim] or [tokens, head_dim], t's dtype)."""
        n, heads, hd = t.shape
        if t.stride(2) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
            raise ValueError("rotary_inplace: head_dim must be contiguous in t, cos and sin alike")
        if n:
            # no fused multiply-add: float32 rounds each product, as torch's separate kernels do
            _rotary_kernel[(n, heads)](t, cos, sin, t.stride(0), t.stride(1), cos.stride(0), HALF=hd // 2,
                                       ROUND=rounding(t.dtype), BLOCK=next_pow2(hd // 2), num_warps=1,
                                       enable_fp_fusion=False)  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of gate_up = [gate | up] along the last dimension."""
        n, width = _rows(gate_up).shape
        half = width // 2
        out = torch.empty(n, half, dtype=gate_up.dtype, device=gate_up.device)
        if n:
            grid = (n, triton.cdiv(half, self.SILU_BLOCK))
            _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), half,
                                   ROUND=rounding(gate_up.dtype), BLOCK=self.SILU_BLOCK,
                                   num_warps=4)  # fmt: skip
        return out
