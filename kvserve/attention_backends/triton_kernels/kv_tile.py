"""The tile load both attention kernels share: one kv head's slice of one paged block.

With the [blocks, kv_heads, block_size, head_dim] layout that slice is a contiguous
[block_size, head_dim] tile. An fp8 tile is dequantized with its per-token bfloat16 scales
((codes * scale) in float32, then the compute dtype), the same arithmetic as
kv_quant.dequantize_kv, so the GPU reads what the CPU path reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    cache_ptr, scale_ptr, block, kv_head, s, d, dmask,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """[BLOCK_SIZE, BLOCK_D] tile of `block` (int64) for `kv_head`, in OUT_DTYPE."""
    base = block * stride_cb + kv_head * stride_ch
    x = tl.load(cache_ptr + base + s[:, None] * stride_cs + d[None, :], mask=dmask[None, :], other=0.0)
    if QUANT:
        scale = tl.load(scale_ptr + block * stride_sb + kv_head * stride_sh + s).to(tl.float32)
        return (x.to(tl.float32) * scale[:, None]).to(OUT_DTYPE)
    return x.to(OUT_DTYPE)
