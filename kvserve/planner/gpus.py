"""GPU catalogue for `kvserve plan`.

Numbers are from vendor spec sheets, dense (no 2:4 sparsity) tensor-core rates.
Memory is what the driver reports as usable (nvidia-smi / rocm-smi total), not the
marketing figure, because that is what the engine can actually fill. Prices are
illustrative on-demand cloud rates in USD per GPU-hour; they drift, so pass
`--price-per-hour` for real decisions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1024**2


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: capacity, speed and a default price."""

    name: str
    memory_bytes: int
    bandwidth_gbps: float  # HBM/GDDR bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16/fp16 tensor TFLOP/s
    fp8_tflops: float | None  # dense fp8 TFLOP/s; None = no fp8 tensor cores
    price_per_hour: float  # USD per GPU-hour, illustrative

    def peak_flops(self, weight_format: str, compute_dtype: str) -> float:
        """FLOP/s for the matmuls: fp8 weights run W8A8 where the GPU has fp8
        tensor cores; everything else (including int4/int8 weight-only
        quantisation) computes in 16-bit; fp32 uses TF32, half the bf16 rate."""
        if weight_format == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        if compute_dtype == "fp32":
            return self.bf16_tflops * 0.5e12
        return self.bf16_tflops * 1e12


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("L4", 23034 * MIB, 300, 121, 242, 0.80),
        GPUSpec("A10G", 23028 * MIB, 600, 70, None, 1.01),
        GPUSpec("RTX-4090", 24564 * MIB, 1008, 165, 330, 0.50),
        GPUSpec("A100-40GB", 40960 * MIB, 1555, 312, None, 1.30),
        GPUSpec("A100-80GB", 81920 * MIB, 2039, 312, None, 1.80),
        GPUSpec("H100-80GB", 81559 * MIB, 3350, 989, 1979, 2.99),
        GPUSpec("H200-141GB", 143771 * MIB, 4800, 989, 1979, 3.50),
        GPUSpec("B200", 183359 * MIB, 8000, 2250, 4500, 6.00),
        GPUSpec("MI300X", 196592 * MIB, 5300, 1307, 2615, 2.50),
    )
}

DEFAULT_GPU = "H100-80GB"

_ALIASES = {
    "4090": "RTX-4090",
    "A100": "A100-80GB",
    "H100": "H100-80GB",
    "H200": "H200-141GB",
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by name, ignoring case and punctuation ("h100", "A100 40GB")."""
    table = {_key(k): v for k, v in GPUS.items()}
    table.update({_key(k): GPUS[v] for k, v in _ALIASES.items()})
    key = _key(name)
    for candidate in (key, key.removeprefix("nvidia"), key.removeprefix("amd")):
        if candidate in table:
            return table[candidate]
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
