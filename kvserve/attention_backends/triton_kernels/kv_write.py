"""KV-cache write: each new token's K and V into its slot, quantized on the way for 1-byte caches.

One program per token: it loads the token's K and V ([kv_heads, head_dim] each) and stores them at
slot = block * block_size + offset of the [blocks, kv_heads, block_size, head_dim] pool (K and
V pools share their strides: both are views of one tensor). A negative slot (a padding row of
a CUDA-graph batch) is skipped. For a 1-byte cache (fp8 e4m3 or int8) the scale is
kv_quant.py's: max|x| / qmax per vector, rounded to bfloat16 before dividing; rounding is
done by hand (rounding.py), so codes and scales are bit-exact those `quantize_kv` gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels import next_pow2
from kvserve.attention_backends.triton_kernels.rounding import round_to_bf16, round_to_e4m3, round_to_int


@triton.jit
def _store_one(
    x_ptr, cache_ptr, scale_ptr, cache_off, scale_off, hmask, mask,
    QUANT: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    """Store one token's [BLOCK_H, BLOCK_D] tile (all its kv heads) at its slot."""
    x = tl.load(x_ptr, mask=mask, other=0.0)
    if QUANT:
        xf = x.to(tl.float32)
        # div_rn: IEEE division, as torch's (Triton's `/` on a GPU is an approximate division);
        # it does not broadcast, hence the operands made the same shape
        amax = tl.max(tl.abs(xf), axis=1)
        scale = round_to_bf16(tl.maximum(tl.div_rn(amax, tl.zeros_like(amax) + QMAX), 1e-8))
        q = tl.div_rn(xf, scale[:, None] + tl.zeros_like(xf))
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        if FP8:
            codes = round_to_e4m3(q)
        else:
            codes = round_to_int(q)
        tl.store(cache_ptr + cache_off, codes.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_off, scale.to(tl.bfloat16), mask=hmask)
    else:
        tl.store(cache_ptr + cache_off, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hmask = h < KV_HEADS
        mask = hmask[:, None] & (d < HEAD_DIM)[None, :]
        cache_off = block * stride_cb + h[:, None] * stride_ch + off * stride_cs + d[None, :]
        scale_off = block * stride_sb + h * stride_sh + off
        k_tile = k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :]
        v_tile = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        _store_one(k_tile, k_cache_ptr, k_scale_ptr, cache_off, scale_off, hmask, mask, QUANT, FP8, QMAX)
        _store_one(v_tile, v_cache_ptr, v_scale_ptr, cache_off, scale_off, hmask, mask, QUANT, FP8, QMAX)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at `slot_mapping` [tokens] (int, -1: skip).

    Caches are [blocks, kv_heads, block_size, head_dim]; with a 1-byte cache, `k_scales` /
    `v_scales` are its [blocks, kv_heads, block_size] bfloat16 scales."""
    n, kvh, hd = k.shape
    if n == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    quant = k_scales is not None
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    ks, vs = (k_scales, v_scales) if quant else (k_cache, v_cache)  # unused pointers when not quantized
    _kv_write_kernel[(n,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        BLOCK_SIZE=k_cache.shape[2], KV_HEADS=kvh, BLOCK_H=next_pow2(kvh), HEAD_DIM=hd, BLOCK_D=next_pow2(hd),
        QUANT=quant, FP8=fp8, QMAX=448.0 if fp8 else 127.0,
    )  # fmt: skip
