"""Caps on oneDNN's caches of compiled kernels, so the process running the model stays bounded.

oneDNN JIT-compiles one kernel per input shape for the packed CPU linears (about 0.6 MB each,
whatever the shape) and keeps it in two LRU caches of 1,024 entries: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and PyTorch's ideep cache in front of it
(`LRU_CACHE_CAPACITY`, per thread). Row counts are padded to buckets (worker/shape_buckets.py),
but 56 buckets x 5 projection shapes still grew the engine core by ~80 MB over a 100,000-line
batch (docs/BENCHMARKS.md, issue 18). A kernel lives while either cache holds it, so both are
capped. A step uses one bucket in every layer, so a steady decode never recompiles; steps of
ever-changing size recompile a few kernels each, ~0.5 ms a kernel: 0.1% of the default model's
time, ~20% more for a 2-layer test model's ~9 ms steps (benchmarks/bench_onednn_cache.py).
Both variables are read when oneDNN first builds a kernel in the process, so this runs before
the model loads; a value already in the environment (the user's) wins.
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
