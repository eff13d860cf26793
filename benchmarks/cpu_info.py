"""The CPU flags every benchmark prints (results differ between AVX2-only and AVX-512/AMX
machines). No torch import: server-side benchmarks read it without loading the engine."""

from __future__ import annotations

WANTED = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(w for w in WANTED if w in flags) or "none of " + ",".join(WANTED)
