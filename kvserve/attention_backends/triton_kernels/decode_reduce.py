"""The split-K reduce of paged decode: merge each (row, head)'s partial softmaxes.

Split i holds acc_i = sum exp(s - m_i) v, its max m_i and sum l_i. With M = max_i m_i the
result is sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i. Empty splits (m = -inf, l = 0)
weigh nothing; a row with no tokens at all (CUDA-graph padding) gives zeros, not NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention_backends.triton_kernels import next_pow2


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    part = (row * NUM_HEADS + head) * num_splits + sp
    m = tl.load(m_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=smask, other=0.0)  # noqa: E741
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - top), 0.0)
    total = tl.sum(l * w, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


def reduce_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """acc [rows, heads, splits, BLOCK_D], m / l [rows, heads, splits] -> out [rows, heads, head_dim]."""
    rows, heads, splits, bd = acc.shape
    if out.stride(-1) != 1:
        raise ValueError("decode reduce: out's last dimension must be contiguous")
    _decode_reduce_kernel[(rows, heads)](
        acc, m, l, out, out.stride(0), out.stride(1), splits,
        NUM_HEADS=heads, BLOCK_S=next_pow2(splits), HEAD_DIM=out.shape[2], BLOCK_D=bd,
    )  # fmt: skip
    return out
