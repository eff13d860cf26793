"""KV-cache arithmetic shared by the engine (to size its pool) and `kvserve plan`.

One formula, two users: the planner's prediction and the running server's allocation
must never disagree, so both call the functions here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "int8": 1,
}
# kvserve's 1-byte KV caches keep one bfloat16 scale per token and kv head (kv_quant.py).
KV_SCALE_BYTES = {"fp8": 2, "fp8_e4m3": 2, "int8": 2}


def parse_memory_size(value: str | int | float) -> int:
    """Parse "2GiB", "512MB", "1.5G" or a plain byte count into bytes."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"memory size must be >= 0, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"invalid memory size {value!r}: use a number with an optional unit such as 512MiB, 2GiB or 4GB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, scale_bytes: int = 0
) -> int:
    """Bytes of K and V one token occupies across all layers (`scale_bytes` per head vector)."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def kv_cache_element_bytes(kv_cache_dtype: str, compute_dtype: str) -> tuple[int, int]:
    """(bytes per element, scale bytes per token and head) of a KV cache type; "auto" is the
    compute dtype."""
    name = compute_dtype if kv_cache_dtype in (None, "auto") else kv_cache_dtype
    return DTYPE_BYTES[name], KV_SCALE_BYTES.get(name, 0)


@dataclass(frozen=True)
class KVPoolSize:
    """What a KV memory budget buys: whole blocks of `block_size` tokens."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def max_concurrency(self, max_model_len: int) -> float:
        """How many sequences of max_model_len tokens fit at once (fractional)."""
        blocks_per_seq = -(-max_model_len // self.block_size)
        return self.num_blocks / blocks_per_seq


def kv_pool_size(budget_bytes: int, block_size: int, bytes_per_token: int) -> KVPoolSize:
    """Number of whole blocks that fit in `budget_bytes`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return KVPoolSize(budget_bytes // (block_size * bytes_per_token), block_size, bytes_per_token)


DEFAULT_GPU_OVERHEAD = 0.3


def gpu_kv_budget(
    total_bytes: int, utilization: float, weight_bytes: int, overhead: float = DEFAULT_GPU_OVERHEAD
) -> int:
    """KV bytes on a GPU: what `utilization` of its memory leaves after the weights, less an
    `overhead` share of that remainder for activations, CUDA graphs and fragmentation."""
    free = int(total_bytes * utilization) - weight_bytes
    return max(free - int(overhead * max(free, 0)), 0)
