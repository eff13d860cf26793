"""Paged decode attention: one query token per row against its paged KV, split-K, then a reduce.

Decode is bandwidth-bound, and one program per (row, kv head) leaves most of a big GPU idle
when the batch is small and contexts long, so each row's blocks are cut into `num_splits`
ranges (split-K, as flash-decoding does): every (row, kv head, split) program runs an online
softmax over its range and writes an unnormalised partial output with its running max and sum;
a second kernel (decode_reduce.py) merges the splits of each (row, head). The number of splits
depends only on the block-table width, a shape, so a captured CUDA graph replays the same
launch; a row shorter than the table leaves its last splits empty.

GQA: a program serves all query heads of one kv head (padded to 16 rows for tl.dot), so K/V
are read once per kv head. Speculative rows are ordinary rows (their own seq_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels import dot_args, next_pow2
from kvserve.attention_backends.triton_kernels.constants import num_decode_splits
from kvserve.attention_backends.triton_kernels.decode_reduce import reduce_splits
from kvserve.attention_backends.triton_kernels.online_softmax import attend_block


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr, sm_scale,
    stride_qt, stride_qh, stride_bt,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
    QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    num_splits = tl.num_programs(2)  # a runtime value: a new split count compiles nothing
    per_split = tl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, num_blocks)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for b in range(first, last):
        block = tl.load(tables_ptr + row * stride_bt + b).to(tl.int64)
        visible = (b * BLOCK_SIZE + s)[None, :] < seq_len
        acc, m, l = attend_block(  # noqa: E741
            q, acc, m, l, visible, sm_scale,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, kv_head, s, d, dmask,
            stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, QUANT, DOT_PRECISION,
        )  # fmt: skip
    # partials are [rows, heads, splits(, head_dim)]
    part = (row * NUM_HEADS + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])
    tl.store(m_ptr + part, m, mask=gmask)
    tl.store(l_ptr + part, l, mask=gmask)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of q [rows, heads, head_dim] over each row's first seq_lens[row] cached
    tokens (block_tables [rows, width]); written into `out` [rows, heads, head_dim]."""
    rows, num_heads, hd = q.shape
    if rows == 0:
        return out
    _, kvh, block_size, _ = k_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"Triton paged attention: block_size {block_size} must be a power of two >= 16")
    q = q if q.stride(-1) == 1 else q.contiguous()
    splits = num_splits or num_decode_splits(block_tables.shape[1], block_size)
    group = num_heads // kvh
    bd = next_pow2(hd)
    acc = torch.empty(rows, num_heads, splits, bd, dtype=torch.float32, device=q.device)
    m = torch.empty(rows, num_heads, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    quant = k_scales is not None
    ks, vs = (k_scales, v_scales) if quant else (k_cache, v_cache)
    _paged_decode_kernel[(rows, kvh, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, acc, m, l, scale,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=hd, BLOCK_D=bd,
        BLOCK_SIZE=block_size, NUM_HEADS=num_heads, QUANT=quant,
        **dot_args(q.dtype),
    )  # fmt: skip
    return reduce_splits(acc, m, l, out)
