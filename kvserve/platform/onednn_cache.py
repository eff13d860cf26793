"""Caps on oneDNN's caches of compiled kernels, so the process running the model stays bounded.

oneDNN JIT-compiles one kernel per input shape for the packed CPU linears (about 0.6 MB each
here, whatever the shape) and keeps it in two LRU caches of 1,024 entries each: oneDNN's
primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and PyTorch's ideep cache in front of it
(`LRU_CACHE_CAPACITY`, per thread). The row-count buckets (worker/shape_buckets.py) leave 56
row counts x 5 projection shapes at the default step budget, so a long batch run grew the
engine core by ~80 MB as it met new buckets (docs/BENCHMARKS.md, issue 18). Either cache alone
keeps a kernel alive, so both are capped. A step reuses one bucket across all layers, so a cap
holds the recent buckets and a steady decode never recompiles; a miss costs a compile of
~0.2-0.5 ms (benchmarks/bench_onednn_cache.py). Both variables are read when oneDNN first
builds a kernel in the process, so this runs before the model loads; a value already set in
the environment (the user's) wins.
"""

from __future__ import annotations

import os

CACHE_CAPACITY = 32  # kernels per cache (~20 MB): about six steps' distinct buckets
CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_onednn_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Set both cache capacities unless already set; returns the values in force."""
    for name in CACHE_VARS:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CACHE_VARS}
