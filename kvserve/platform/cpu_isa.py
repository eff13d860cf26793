"""Which vector instructions this CPU has, and what that means for each compute path.

The same wheel runs on AVX2-only laptops, AVX-512 servers and AMX Sapphire Rapids, and the
fastest path differs between them: bfloat16 matmuls are 2x faster than float32 where the
CPU has avx512_bf16 / AMX, and 4x *slower* where it does not (oneDNN refuses to pack bf16
weights there and `F.linear` takes a generic path). So the engine reads the flags once at
start, logs them with the kernel each path will use, and never picks a path known to be
slower than float32 on the machine at hand (`cpu_compute_dtype`).

`ONEDNN_MAX_CPU_ISA` (oneDNN's own cap, also used to emulate an older CPU in benchmarks)
is honoured: flags above the cap are dropped, because oneDNN will not use them.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The flags the dispatch looks at (names as /proc/cpuinfo spells them).
WANTED = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "amx_bf16", "amx_int8", "amx_tile",
)  # fmt: skip

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA values), lowest first, and the flags each one adds.
_CAPS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SSE41", frozenset()),
    ("AVX", frozenset()),
    ("AVX2", frozenset({"avx2", "fma"})),
    ("AVX2_VNNI", frozenset({"avx_vnni"})),
    ("AVX2_VNNI_2", frozenset()),
    ("AVX512_CORE", frozenset({"avx512f", "avx512bw", "avx512vl"})),
    ("AVX512_CORE_VNNI", frozenset({"avx512_vnni"})),
    ("AVX512_CORE_BF16", frozenset({"avx512_bf16"})),
    ("AVX10_1_512", frozenset()),
    ("AVX512_CORE_FP16", frozenset()),
    ("AVX512_CORE_AMX", frozenset({"amx_bf16", "amx_int8", "amx_tile"})),
)


@dataclass(frozen=True)
class CpuIsa:
    """The wanted flags present (after any oneDNN cap), with the questions dispatch asks."""

    flags: frozenset[str]

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot products in one instruction (VNNI, 512- or 256-bit)."""
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags and bool({"amx_bf16", "amx_int8"} & self.flags)

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware: what makes bf16 matmuls faster than fp32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def describe(self) -> str:
        return " ".join(f for f in WANTED if f in self.flags) or "no AVX2"


def cpu_flags_line(path: str = "/proc/cpuinfo") -> str:
    """The first `flags` line's value ('' where there is none, e.g. not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first `flags` line's words."""
    return frozenset(cpu_flags_line(path).split())


def cap_flags(flags: frozenset[str], max_isa: str | None) -> frozenset[str]:
    """`flags` without those above oneDNN's cap `max_isa` (unknown or unset: no cap)."""
    names = [name for name, _ in _CAPS]
    if not max_isa or max_isa.upper() not in names:
        return flags
    above = _CAPS[names.index(max_isa.upper()) + 1 :]
    return flags - frozenset().union(*(added for _, added in above))


@functools.cache
def hardware_isa() -> CpuIsa:
    """This machine's ISA, read once. What decides whether a module built with wider
    instructions may be loaded at all: tests replace `cpu_isa`, never this."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    flags = cap_flags(read_cpu_flags(), cap)
    return CpuIsa(frozenset(f for f in WANTED if f in flags))


def cpu_isa() -> CpuIsa:
    """This machine's ISA for dispatch decisions (tests monkeypatch this function's result)."""
    return hardware_isa()


def cpu_compute_dtype(dtype: str, device_type: str, isa: CpuIsa | None = None) -> str:
    """The compute dtype to use for a requested one: bfloat16 on a CPU without native bf16
    becomes float32, with a warning (measured 2-6x slower than fp32 there: docs/BENCHMARKS.md,
    "CPU ISA dispatch")."""
    if dtype != "bfloat16" or device_type != "cpu":
        return dtype
    isa = isa or cpu_isa()
    if isa.native_bf16:
        return dtype
    logger.warning(
        "dtype bfloat16: this CPU has no avx512_bf16 / amx_bf16 (flags: %s), where bf16 matmuls "
        "are several times slower than float32; computing in float32 instead",
        isa.describe(),
    )
    return "float32"
