"""The CPU flags every benchmark prints (results differ between AVX2-only and AVX-512/AMX
machines). No torch import: server-side benchmarks read it without loading the engine."""

from __future__ import annotations

import importlib.util
import os
import sys

WANTED = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> str:
    """The wanted flags this CPU has; where ONEDNN_MAX_CPU_ISA caps them (an older CPU emulated,
    in part: oneDNN and kvserve's quantized matmuls stop there, kvserve's other C++ is built for
    this CPU and fbgemm ignores the cap), the cap and what is left."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    cap = isa_cap()
    if not cap:
        return _wanted(flags)
    capped = _cpu_isa().cap_flags(frozenset(flags), cap)
    return f"{_wanted(flags)}; capped by ONEDNN_MAX_CPU_ISA={cap} to: {_wanted(capped)}"


def isa_cap() -> str | None:
    """oneDNN's ISA cap where one is set (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA;
    benchmarks/avx2_emulated.sh --native sets it), else None."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None


def _wanted(flags) -> str:
    return " ".join(w for w in WANTED if w in flags) or "none of " + ",".join(WANTED)


def _cpu_isa():
    """kvserve/platform/cpu_isa.py loaded by path: importing the kvserve package imports torch."""
    name = "_kvserve_cpu_isa"
    if name not in sys.modules:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(root, "kvserve", "platform", "cpu_isa.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]
