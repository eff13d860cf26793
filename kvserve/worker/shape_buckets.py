"""Row counts padded to a small fixed set, so the matmul kernels compiled stay bounded.

oneDNN (behind the packed CPU linears and bfloat16 matmuls) JIT-compiles one kernel per input
shape and caches it: about 0.6 MB each. With the flat batch's token count free to take any
value from 1 to the step budget, a server that runs long enough compiles a kernel for nearly
every count, which showed up as the engine process growing by hundreds of MB over a soak
(docs/BENCHMARKS.md). Padding every batch to one of a few sizes (exact up to 16 rows, then
eight sizes per doubling: at most 12.5% padding) keeps that set finite, like the capture sizes
of CUDA graphs in vLLM, and small enough that the capped caches (platform/onednn_cache.py,
32 kernels) mostly hit. Rows are independent in every
projection and norm, so padding rows never change a real row's result.
"""

from __future__ import annotations

EXACT_UP_TO = 16
STEPS_PER_DOUBLING = 8


def padded_rows(n: int) -> int:
    """The bucket holding n rows: n itself up to 16, else n rounded up to 1/8 of its power of two."""
    if n <= EXACT_UP_TO:
        return n
    granule = (1 << (n.bit_length() - 1)) // STEPS_PER_DOUBLING
    return -(-n // granule) * granule


def all_buckets(max_rows: int) -> list[int]:
    """Every bucket a batch of 1..max_rows rows can land in, smallest first."""
    sizes, n = [], 1
    while n <= max_rows:
        b = padded_rows(n)
        sizes.append(b)
        n = b + 1
    return sizes
