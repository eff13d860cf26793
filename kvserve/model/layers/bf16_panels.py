"""bfloat16 projections through kvserve's AVX512-BF16 panel kernel (csrc/bf16_matmul_cpu.cpp)
where that beats oneDNN: CPUs with avx512_bf16 and no AMX.

There oneDNN's packed bf16 linear reads a one-row decode step's weights at about half of
the memory's speed (docs/BENCHMARKS.md, issue 16 round 21); the panel kernel streams them once.
With AMX oneDNN's tiles are the faster path for batches and it stays in charge. The module is
built with explicit flags (-mavx512bf16, never -march=native) and loaded only on a CPU that
runs them; `KVSERVE_BF16_PANELS=0` (or KVSERVE_DISABLE_CPU_KERNELS) keeps oneDNN everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

import torch

from kvserve.model.layers.cpu_kernels import build_extension
from kvserve.platform.cpu_isa import CpuIsa, hardware_isa

logger = logging.getLogger(__name__)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc", "bf16_matmul_cpu.cpp")
CFLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
PANEL_ROWS = 16

_lock = threading.Lock()
_state: dict[str, object] = {}


def panels_wanted(isa: CpuIsa | None = None) -> bool:
    """Whether bf16 projections should use the panel kernel on this CPU (see the module doc).
    The real flags, never a test's stand-in: the module executes AVX-512 BF16 as it loads."""
    isa = isa or hardware_isa()
    if os.environ.get("KVSERVE_BF16_PANELS") == "0" or os.environ.get("KVSERVE_DISABLE_CPU_KERNELS"):
        return False
    return isa.avx512 and "avx512_bf16" in isa.flags and not isa.amx


def _build_name() -> str:
    """The module's name hashes its source, its flags and the torch install it builds against."""
    with open(SRC, "rb") as f:
        source = f.read()
    where = os.path.dirname(torch.__file__) + torch.__version__
    key = hashlib.sha256(source + " ".join(CFLAGS).encode() + where.encode())
    return f"kvserve_bf16_{key.hexdigest()[:10]}"


def load_bf16_kernels():
    """The compiled module, or None where it is not wanted or cannot be built."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            module = None
            if panels_wanted():
                try:
                    module = build_extension(_build_name(), [SRC], CFLAGS)
                except Exception as e:  # no compiler, or one without -mavx512bf16
                    logger.warning("bf16 panel kernel unavailable (%s); using oneDNN for bfloat16", e)
            _state["module"] = module
    return _state["module"]


def panel_layout(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (N a multiple of 16, K even) as [N/16, K/2, 32]: in panel p, chunk
    j, element 2r + i is row 16p + r's weight for input 2j + i."""
    n, k = weight.shape
    w = weight.detach().reshape(n // PANEL_ROWS, PANEL_ROWS, k // 2, 2)
    return w.permute(0, 2, 1, 3).reshape(n // PANEL_ROWS, k // 2, 2 * PANEL_ROWS).contiguous()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """`panel_layout(weight)`, or None where the kernel does not apply here (not wanted or not
    built, another dtype or device, N not whole panels, K odd)."""
    n, k = weight.shape if weight.dim() == 2 else (0, 1)
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or n == 0 or n % PANEL_ROWS or k % 2
            or load_bf16_kernels() is None):  # fmt: skip
        return None
    return panel_layout(weight)


def unpack_bf16(panels: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of `panel_layout`'s layout."""
    p, k2, _ = panels.shape
    return panels.view(p, k2, PANEL_ROWS, 2).permute(0, 2, 1, 3).reshape(p * PANEL_ROWS, k2 * 2)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight in `panel_layout`'s layout, [*ids.shape, K]: a tied table's
    embedding lookups served from its lm_head's panels, so the table is held once."""
    p, k2, _ = panels.shape
    flat = ids.reshape(-1)
    rows = panels.view(p, k2, PANEL_ROWS, 2)[flat // PANEL_ROWS, :, flat % PANEL_ROWS]
    return rows.reshape(*ids.shape, k2 * 2)


def bf16_panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for W in `panel_layout`'s layout, x bf16 [..., K]."""
    mod = load_bf16_kernels()
    lead = x.shape[:-1]
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    y = mod.bf16_mm(x.reshape(-1, x.shape[-1]).contiguous(), panels, bias)
    return y.view(*lead, y.shape[-1])
