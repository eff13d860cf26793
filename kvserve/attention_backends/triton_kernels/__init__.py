"""Triton kernels for the CUDA attention backend, one kernel per file.

Nothing here imports triton at package import; each kernel module does, and only the Triton
backend (attention_backends/triton_backend.py) imports them, after `require_triton` has said
clearly what is missing. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors
(tests/test_triton_kernels.py).

KV layout: the pool keeps kvserve's own [num_blocks, kv_heads, block_size, head_dim] on the GPU
too (docs/CUDA.md says why): one kv head's slice of a block is a contiguous
[block_size, head_dim] tile, which is exactly the tile these kernels load per step of their
loops, and every other part of kvserve that touches blocks (copy-on-write, the KV transfer
byte layout, the 1-byte cache's [blocks, kv_heads, block_size] scales) stays as it is.
"""

from __future__ import annotations

import os


def require_triton():
    """The triton module, or an ImportError that says how to get it."""
    try:
        import triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the Triton attention backend needs triton (CUDA builds of torch install it; "
            "pip install triton==3.7.1 for torch 2.13), or set KVSERVE_ATTENTION_BACKEND=cpu"
        ) from e
    return triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run in numpy on the CPU: keep tiles small)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_args(dtype) -> dict:
    """tl.dot settings for a compute dtype: IEEE fp32 (not TF32) for float32 models, so the GPU
    matches the CPU path; and UPCAST of bfloat16 tiles to float32 under the interpreter, whose
    tl.dot (triton 3.7.1) returns garbage for bfloat16 operands (its numpy has no bfloat16)."""
    import torch

    upcast = interpreting() and dtype == torch.bfloat16
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}
