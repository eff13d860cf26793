"""Varlen prefill / chunked-prefill attention over the paged KV: every prompt chunk of a step in
one launch.

The step's new K/V are written to the cache first (kv_write.py), so a chunk reads all its keys
- the cached prefix (an earlier chunk, or a prefix-cache hit) and its own - through its block
table; one rule covers a fresh prompt, a later chunk and a prefix hit: query row r of a chunk
whose first token is at position `context_len` sees key positions <= context_len + r. With an
fp8 cache the chunk thus attends to its own K/V after the quantization round trip, as the CPU
path does.

Grid: (chunk, query head, query tile of BLOCK_M rows). `query_start` [chunks + 1] are the
chunks' first rows in the flat batch (cu_seqlens); tiles past a chunk's length exit at once.
Each program loops over the blocks up to its tile's last causal key only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels import dot_args, interpreting, next_pow2
from kvserve.attention_backends.triton_kernels.online_softmax import attend_block

# At 4 warps a 64 x 128 float32 accumulator and its q tile spill (tests/triton_compile_check.py).
NUM_WARPS = 8


def prefill_block_m(dtype: torch.dtype) -> int:
    """Query rows per program: 64 for 16-bit models, 32 for float32 (its tiles are twice the
    registers), 16 under the interpreter (numpy time grows with the tile)."""
    return 16 if interpreting() else 32 if dtype == torch.float32 else 64


@triton.jit
def _paged_prefill_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    tables_ptr, query_start_ptr, context_lens_ptr, sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + chunk).to(tl.int32)
    q_len = tl.load(query_start_ptr + chunk + 1).to(tl.int32) - q_start
    if tile * BLOCK_M < q_len:
        context = tl.load(context_lens_ptr + chunk).to(tl.int32)
        kv_head = head // GROUP
        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < q_len
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        s = tl.arange(0, BLOCK_SIZE)
        rows = (q_start + r).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=rmask[:, None] & dmask[None, :], other=0.0,
        )  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = context + tl.minimum((tile + 1) * BLOCK_M, q_len)  # keys past it are in no row's past
        for b in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
            block = tl.load(tables_ptr + chunk * stride_bt + b).to(tl.int64)
            visible = (b * BLOCK_SIZE + s)[None, :] <= (context + r)[:, None]  # causal, offset
            acc, m, l = attend_block(  # noqa: E741
                q, acc, m, l, visible, sm_scale,
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, kv_head, s, d, dmask,
                stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, QUANT, DOT_PRECISION,
            )  # fmt: skip
        o = acc / l[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :],
        )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for every chunk: rows query_start[i]:query_start[i + 1] of q / out
    [tokens, heads, head_dim], chunk i starting at position context_lens[i] of its table."""
    chunks = context_lens.shape[0]
    if chunks == 0:
        return out
    _, num_heads, hd = q.shape
    _, kvh, block_size, _ = k_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"Triton paged attention: block_size {block_size} must be a power of two >= 16")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_m = prefill_block_m(q.dtype)
    quant = k_scales is not None
    ks, vs = (k_scales, v_scales) if quant else (k_cache, v_cache)
    grid = (chunks, num_heads, -(-max_query_len // block_m))
    _paged_prefill_kernel[grid](
        q, out, k_cache, v_cache, ks, vs, block_tables, query_start, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        GROUP=num_heads // kvh, HEAD_DIM=hd, BLOCK_D=next_pow2(hd), BLOCK_M=block_m,
        BLOCK_SIZE=block_size, QUANT=quant, **dot_args(q.dtype), num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
