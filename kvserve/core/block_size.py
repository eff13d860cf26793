"""The KV block sizes the GPU attention kernels page with: one rule for the engine (the Triton
backend refuses another at start) and `kvserve plan` (which refuses it at parse), so a plan
never sizes a pool the server it describes would not start with."""

from __future__ import annotations

MIN_GPU_BLOCK_SIZE = 16


def gpu_block_size_problem(block_size: int) -> str | None:
    """Why the GPU kernels cannot use `block_size` tokens a block (their tiles split a block in
    powers of two, at least 16), or None when they can."""
    if block_size < MIN_GPU_BLOCK_SIZE or block_size & (block_size - 1):
        return (
            f"block_size must be a power of two >= {MIN_GPU_BLOCK_SIZE} (16, 32, 64, ...), got {block_size}"
        )
    return None
