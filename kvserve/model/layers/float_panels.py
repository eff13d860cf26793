"""float32 and bfloat16 projections through kvserve's AVX-512 panel kernels
(csrc/float_panels_cpu.cpp) where they beat oneDNN: AVX-512 CPUs without AMX.

There oneDNN's packed linear reads a one-row decode step's weights at about half of the
memory's speed (fp32 ~20, bf16 ~13 GB/s against ~33; docs/BENCHMARKS.md, issue 16 round 21);
the panels stream them once and match oneDNN from 32 rows up. With AMX oneDNN stays in charge
(its bf16 tiles; the panels were not measured there), and AVX2-only CPUs keep oneDNN too (no
AVX2 form yet). The module is built with explicit flags, never -march=native, in two variants
(with -mavx512bf16 for both kernels, without it for fp32 only), and loaded only where the real
CPU flags run it. `KVSERVE_FLOAT_PANELS=0` (or KVSERVE_DISABLE_CPU_KERNELS) keeps oneDNN.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from kvserve.model.layers.cpu_kernels import build_extension, extension_name
from kvserve.platform.cpu_isa import CpuIsa, hardware_isa

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc")
SRC = os.path.join(_CSRC, "float_panels_cpu.cpp")
_AVX512 = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
VARIANTS = {"avx512_bf16": [*_AVX512, "-mavx512bf16"], "avx512": _AVX512}
PANEL_ROWS = 16
_KERNEL = {torch.float32: "fp32_mm", torch.bfloat16: "bf16_mm"}

_lock = threading.Lock()
_state: dict[str, object] = {}


def panel_variant(isa: CpuIsa | None = None) -> str | None:
    """The module variant this CPU runs, or None where the panels are not wanted (see the
    module doc). The real flags, never a test's stand-in: the module executes AVX-512 as it
    loads."""
    isa = isa or hardware_isa()
    if os.environ.get("KVSERVE_FLOAT_PANELS") == "0" or os.environ.get("KVSERVE_DISABLE_CPU_KERNELS"):
        return None
    if not isa.avx512 or isa.amx:
        return None
    return "avx512_bf16" if "avx512_bf16" in isa.flags else "avx512"


def _build_name(variant: str) -> str:
    with open(SRC, "rb") as f:
        return extension_name(f"kvserve_float_panels_{variant}", f.read(), VARIANTS[variant])


def load_panel_kernels():
    """The compiled module for this CPU, or None where it is not wanted (asked each call: a
    test may switch the panels off) or cannot be built."""
    if panel_variant() is None:
        return None
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            module, variant = None, panel_variant()
            try:
                module = build_extension(_build_name(variant), [SRC], VARIANTS[variant])
            except Exception as e:  # no compiler, or one without these flags
                logger.warning("float panel kernels unavailable (%s); using oneDNN", e)
            _state["module"] = module
    return _state["module"]


def _slot(dtype: torch.dtype) -> int:
    """Inputs per 32-bit slot of a chunk: 1 for float32, 2 for bfloat16."""
    return 4 // dtype.itemsize


def panel_layout(weight: torch.Tensor) -> torch.Tensor:
    """A float32 / bf16 [N, K] weight (N a multiple of 16, K a multiple of g = 4 / element
    size) as [N/16, K/g, 16 g]: in panel p, chunk j, element g r + i is row 16p + r's weight
    for input g j + i."""
    n, k = weight.shape
    g = _slot(weight.dtype)
    w = weight.detach().reshape(n // PANEL_ROWS, PANEL_ROWS, k // g, g)
    return w.permute(0, 2, 1, 3).reshape(n // PANEL_ROWS, k // g, PANEL_ROWS * g).contiguous()


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """`panel_layout(weight)`, or None where no panel kernel applies here (not wanted or not
    built, bf16 without avx512_bf16, another dtype or device, N not whole panels, K odd)."""
    n, k = weight.shape if weight.dim() == 2 else (0, 1)
    if weight.dtype not in _KERNEL or weight.device.type != "cpu" or n == 0 or n % PANEL_ROWS:
        return None
    mod = load_panel_kernels()
    if mod is None or not hasattr(mod, _KERNEL[weight.dtype]) or k % _slot(weight.dtype):
        return None
    return panel_layout(weight)


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of `panel_layout`'s layout."""
    p, chunks, width = panels.shape
    g = width // PANEL_ROWS
    return panels.view(p, chunks, PANEL_ROWS, g).permute(0, 2, 1, 3).reshape(p * PANEL_ROWS, chunks * g)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight in `panel_layout`'s layout, [*ids.shape, K]: a tied table's
    embedding lookups served from its lm_head's panels, so the table is held once."""
    p, chunks, width = panels.shape
    g = width // PANEL_ROWS
    flat = ids.reshape(-1)
    rows = panels.view(p, chunks, PANEL_ROWS, g)[flat // PANEL_ROWS, :, flat % PANEL_ROWS]
    return rows.reshape(*ids.shape, chunks * g)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for W in `panel_layout`'s layout, x [..., K] of the panels' dtype."""
    kernel = getattr(_state["module"], _KERNEL[panels.dtype])  # the module that packed them
    if bias is not None:
        bias = bias.to(panels.dtype).contiguous()
    lead = x.shape[:-1]
    y = kernel(x.reshape(-1, x.shape[-1]).contiguous(), panels, bias)
    return y.view(*lead, y.shape[-1])
