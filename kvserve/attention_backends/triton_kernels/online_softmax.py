"""One online-softmax step over one paged block: the loop body both attention kernels share.

Decode (a group of query heads of one token) and prefill (a tile of query rows of one head)
differ only in which rows they hold, which blocks they visit and which keys each row may see;
the step itself, scores -> running max -> rescaled accumulator and sum (flash attention's
recurrence), is the same, so it lives here once. The caller says what is visible with a
[rows, BLOCK_SIZE] (or broadcastable) mask and divides acc by l at the end (or hands the
unnormalised partial on, as split-K decode does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels.kv_tile import load_kv_tile


@triton.jit
def attend_block(
    q, acc, m, l, visible, sm_scale,  # noqa: E741
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, kv_head, s, d, dmask,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """(acc, m, l) after the keys of `block` (int64) that `visible` allows: q [rows, BLOCK_D],
    acc [rows, BLOCK_D] float32, m (running max) and l (running sum) [rows] float32."""
    k = load_kv_tile(
        k_cache_ptr, k_scale_ptr, block, kv_head, s, d, dmask,
        stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, QUANT, q.dtype,
    )  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    v = load_kv_tile(
        v_cache_ptr, v_scale_ptr, block, kv_head, s, d, dmask,
        stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, QUANT, q.dtype,
    )  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
    return acc, m_new, l
