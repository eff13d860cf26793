"""A KV pool that cannot hold one sequence of max_model_len tokens. Such a server started and
looked healthy, then refused every request past the pool's size (a fraction of the context it
advertised) with a 400. `kvserve serve` refuses it at start, as vLLM does, when --max-model-len
was given; under the model's own context it warns (test and benchmark setups serve the default
model's 8k context from pools of tens of MiB)."""

from __future__ import annotations

import math

from kvserve.engine.core_proc import Ready


def _size(nbytes: int) -> str:
    """A size --kv-cache-memory takes, rounded up."""
    if nbytes >= 2**20:
        return f"{math.ceil(nbytes / 2**20)}MiB"
    return f"{math.ceil(nbytes / 2**10)}KiB"


def short_pool_error(ready: Ready) -> str | None:
    """What to change, when the pool has fewer blocks than one max_model_len sequence takes."""
    need = -(-ready.max_model_len // ready.block_size)
    if ready.num_blocks >= need:
        return None
    block_bytes = ready.kv_cache_bytes // ready.num_blocks
    tokens = ready.num_blocks * ready.block_size
    return (
        f"kv_cache_memory: the KV pool holds {tokens} tokens ({ready.num_blocks} blocks of "
        f"{ready.block_size}), less than one sequence of max_model_len {ready.max_model_len} tokens "
        f"({need} blocks); raise --kv-cache-memory to at least {_size(need * block_bytes)} (on a GPU "
        f"without it, --gpu-memory-utilization) or lower --max-model-len to at most {tokens}"
    )
