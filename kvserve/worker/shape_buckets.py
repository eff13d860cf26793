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

With a 1-byte KV cache, float projections run one row as two (`min_rows`, set by the model
runner). For a single row oneDNN takes another float32 kernel (a matrix-vector product) that
sums a long dot product (K >= ~1536: the default model's down projection) in another order
than for two rows or more, so a request decoding alone got other last bits than beside
others; the cache's codes turn such bits at a rounding edge into steps, and greedy text
changed. The second row costs 1.06-1.10x the time of a float32 token at one stream (default
model, AMX host, medians of 8 alternating runs, twice), so a float cache, where the bits stay
~1e-6 apart, keeps one row.
"""

from __future__ import annotations

EXACT_UP_TO = 16
STEPS_PER_DOUBLING = 8


def padded_rows(n: int, min_rows: int = 1) -> int:
    """The bucket holding n rows: n itself (at least `min_rows`) up to 16, else n rounded up to
    1/8 of its power of two."""
    if n <= EXACT_UP_TO:
        return max(n, min_rows) if n else n
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
