"""Builds and loads the native int4 / int8 matmuls (csrc/quant_matmul_cpu.cpp), one variant
per ISA, and packs weights into their 16-row panel layouts.

The source is compiled with explicit instruction-set flags per variant, never -march=native,
so a build (or a wheel) made on one CPU is correct on another: the variant is chosen at run
time from `platform/cpu_isa.py`'s detection, which honours ONEDNN_MAX_CPU_ISA. Each variant
is its own extension module (its name hashes the source, the flags and the torch install),
built once under cpu_kernels' fcntl lock and cached. `KVSERVE_QUANT_ISA` forces a variant
(e.g. `generic`, the plain C++ fallback every machine runs); `KVSERVE_DISABLE_CPU_KERNELS`
turns the native path off. If a build fails, callers keep PyTorch's kernels.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from kvserve.model.layers.cpu_kernels import build_extension, extension_name
from kvserve.platform.cpu_isa import CpuIsa, cpu_isa

logger = logging.getLogger(__name__)

SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc", "quant_matmul_cpu.cpp"
)
_COMMON = ["-O3", "-fopenmp"]
# Variant -> compiler flags, best first.
_VNNI = [*_COMMON, "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
VARIANTS: dict[str, list[str]] = {
    "avx512_amx": [*_VNNI, "-mamx-tile", "-mamx-int8"],  # VNNI plus AMX tiles for 16+ rows
    "avx512_vnni": _VNNI,
    "avx2": [*_COMMON, "-mavx2", "-mfma"],
    "generic": list(_COMMON),
}

_lock = threading.Lock()
_modules: dict[str, object] = {}
_failed: set[str] = set()


def runnable_variants(isa: CpuIsa | None = None) -> list[str]:
    """The variants this CPU can execute, best first (`generic` always)."""
    isa = isa or cpu_isa()
    out = []
    if isa.avx2 and isa.avx512 and "avx512_vnni" in isa.flags:
        if "amx_int8" in isa.flags and "amx_tile" in isa.flags:
            out.append("avx512_amx")
        out.append("avx512_vnni")
    if isa.avx2:
        out.append("avx2")
    return [*out, "generic"]


def selected_variant() -> str:
    """The variant QuantizedLinear uses here: forced by KVSERVE_QUANT_ISA, else the best."""
    forced = os.environ.get("KVSERVE_QUANT_ISA")
    if forced:
        if forced not in VARIANTS:
            raise ValueError(f"KVSERVE_QUANT_ISA={forced!r}: not one of {', '.join(VARIANTS)}")
        return forced
    return runnable_variants()[0]


# Variant -> how its int4 tiles read their codes, as chosen at load (for the start-up log).
INT4_TILES: dict[str, str] = {}


def int4_unpacked_time_ratio(module, rows: int = 32, k: int = 576, n: int = 1536, reps: int = 15) -> float:
    """The median time of an int4_mm call of `rows` x [n, k] (random codes) with the tiles
    reading unpacked codes, over the same call reading packed ones; calls alternate, after one
    of each to warm up. Leaves the unpacked form on."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n // 16, k // 8, 64), dtype=torch.uint8, generator=gen)
    sz = (torch.rand(n // 16, k // 32, 2, 16, generator=gen) * 0.01).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * reps + 2):
        on = i % 2 == 1
        module.set_int4_unpacked(on)
        t0 = time.perf_counter()
        module.int4_mm(x, codes, sz, n)
        if i >= 2:
            times[on].append(time.perf_counter() - t0)
    return statistics.median(times[True]) / statistics.median(times[False])


def choose_int4_unpacked(module, variant: str) -> bool:
    """Whether `module`'s int4 tiles of 4+ rows read each panel's codes unpacked once
    (csrc/quant_matmul_cpu.cpp, unpacked_rows_i4: the AVX2 variant's form), set on it and
    returned. `KVSERVE_INT4_UNPACKED` (0 or 1) decides if set; else both forms are timed here
    (int4_unpacked_time_ratio: ~10 ms on 2 cores). Which is faster depends on the cores, not on
    their flags: on an Emerald Rapids (three vector ports) unpacking took 0.78-0.84x the time at
    32-96 rows, while on a Zen 3 (four pipes) a standalone form of it ran at 0.83-0.88x the speed
    (docs/BENCHMARKS.md, issue 16 rounds 20, 34 and 35). Both give the same bits."""
    if not module.set_int4_unpacked(True):
        return False  # this variant has no unpacked form
    forced = os.environ.get("KVSERVE_INT4_UNPACKED")
    if forced in ("0", "1"):
        on, why = forced == "1", f"KVSERVE_INT4_UNPACKED={forced}"
    else:
        if forced:
            logger.warning("KVSERVE_INT4_UNPACKED=%r: not 0 or 1, ignored", forced)
        ratio = int4_unpacked_time_ratio(module)
        on, why = ratio < 1.0, f"measured at load: {ratio:.2f}x the packed tiles' time"
    module.set_int4_unpacked(on)
    INT4_TILES[variant] = f"{'unpacked' if on else 'packed'} codes from 4 rows ({why})"
    return on


def build_name(variant: str, source: bytes) -> str:
    return extension_name(f"kvserve_quant_{variant}", source, VARIANTS[variant])


def kernels_for(variant: str):
    """The module of a variant a layer already chose (QuantizedLinear's per-call path: one dict
    lookup; a process that unpickled the layer loads it on first use)."""
    return _modules.get(variant) or load_quant_kernels(variant)


def load_quant_kernels(variant: str | None = None):
    """The compiled module of `variant` (default: `selected_variant()`), or None if disabled,
    if this CPU cannot run it (importing it would already execute its instructions), or if it
    cannot be built."""
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS"):
        return None
    variant = variant or selected_variant()
    if variant in _modules:  # the per-call path: no lock
        return _modules[variant]
    if variant not in runnable_variants():
        logger.warning("native int4 kernel: this CPU cannot run the %s variant", variant)
        return None
    with _lock:
        if variant in _modules or variant in _failed:
            return _modules.get(variant)
        try:
            with open(SRC, "rb") as f:
                source = f.read()
            module = build_extension(build_name(variant, source), [SRC], VARIANTS[variant])
            choose_int4_unpacked(module, variant)
            _modules[variant] = module
        except Exception as e:  # no compiler, or flags it does not know
            logger.warning(
                "native int4 kernel (%s) unavailable (%s); using PyTorch's int4 kernel", variant, e
            )
            _failed.add(variant)
        return _modules.get(variant)


def compile_only(variant: str) -> str:
    """Compile `variant` to an object file without loading it (for variants this CPU cannot
    run); returns its path, cached by source/flags hash. Raises CalledProcessError on errors."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import _get_build_directory, include_paths

    with open(SRC, "rb") as f:
        name = build_name(variant, f.read())
    out = os.path.join(_get_build_directory(name, verbose=False), f"{name}.o")
    if not os.path.exists(out):
        includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
        cmd = ["c++", "-c", SRC, "-o", out + ".tmp", "-std=c++17", "-fPIC", *VARIANTS[variant], *includes,
               f"-DTORCH_EXTENSION_NAME={name}"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(out + ".tmp", out)
    return out


PANEL_ROWS = 16  # output rows per panel of the int4 and int8 layouts


def _panel_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` ([N, ...]) padded with zero rows to whole panels, and the number of panels."""
    panels = -(-t.shape[0] // PANEL_ROWS)
    pad = panels * PANEL_ROWS - t.shape[0]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)), panels


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int4 layout from QWeight's parts (codes [N, K] in 0..15, scales and zeros
    [N, K/32]): panels of 16 output rows, the last padded with zero codes and scales.
    - codes uint8 [P, K/8, 64]: in panel p, chunk j, byte 4r + i holds row 16p + r's code for
      input 8j + i (low nibble) and 8j + 4 + i (high nibble);
    - bf16 [P, K/32, 2, 16]: per panel and group, the 16 rows' scales, then their zeros.
    (csrc/quant_matmul_cpu.cpp says why: one VNNI dot product feeds 16 outputs.)"""
    k = codes.shape[1]
    padded, p = _panel_rows(codes)
    c = padded.view(p, PANEL_ROWS, k // 8, 2, 4)
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 1, 3).reshape(p, k // 8, 64).contiguous()
    s, z = (_panel_rows(t)[0].view(p, PANEL_ROWS, k // 32).transpose(1, 2) for t in (scales, zeros))
    return packed, torch.stack([s, z], 2).to(torch.bfloat16).contiguous()


def unpack_int4(
    packed: torch.Tensor, sz: torch.Tensor, n: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float [n, K] weight of `pack_int4`'s layout: (q - 8) * scale + zero."""
    p, k8, _ = packed.shape
    b = packed.view(p, k8, PANEL_ROWS, 4).permute(0, 2, 1, 3)  # [P, 16, K/8, 4]
    q = torch.stack([b & 15, b >> 4], 3).reshape(p, PANEL_ROWS, k8 * 8).float() - 8
    s = sz.float().permute(0, 3, 1, 2).repeat_interleave(32, 2)  # [P, 16, K, 2]
    w = q * s[..., 0] + s[..., 1]
    return w.reshape(p * PANEL_ROWS, k8 * 8)[:n].to(dtype)


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 layout from per-row codes [N, K] and scales [N]: int8 [P, K/4, 64]
    (in panel p, chunk j, byte 4r + i is row 16p + r's code for input 4j + i) and bf16
    scales [P * 16], the last panel padded with zeros."""
    k = codes.shape[1]
    padded, p = _panel_rows(codes)
    c = padded.view(p, PANEL_ROWS, k // 4, 4).permute(0, 2, 1, 3)
    return c.reshape(p, k // 4, 64).contiguous(), _panel_rows(scales)[0].to(torch.bfloat16).contiguous()


def int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the int8 codes in `pack_int8`'s layout, as [len(ids), K] (embedding lookups)."""
    p, k4, _ = packed.shape
    panels = packed.view(p, k4, PANEL_ROWS, 4)
    return panels[ids // PANEL_ROWS, :, ids % PANEL_ROWS].reshape(len(ids), k4 * 4)
