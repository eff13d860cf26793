"""Dense projections, with oneDNN weight prepacking on CPU.

PyTorch's default CPU matmul repacks the weight matrix on every call; at decode batch
sizes that repacking costs as much as the multiplication. oneDNN can pack a weight once
(at load) into its blocked layout, which measured about 2x faster here for the shapes of
a small decoder (benchmarks/bench_engine.py). On other devices, or if packing is not
supported, the plain `F.linear` path is used. On an AVX-512 CPU without AMX, float32 and
bfloat16 weights take kvserve's own panel layout and kernels instead (float_panels.py: up to
~1.7x oneDNN's speed at decode batch sizes there, level with it for prefills).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvserve.model.layers.float_panels import pack_panels, panel_linear

logger = logging.getLogger(__name__)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's packed layout, or None when that is not available here."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError) as e:
        logger.info("oneDNN weight packing unavailable for %s (%s); using F.linear", weight.dtype, e)
        return None


def pack_float(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in the fastest packed layout here (kvserve's panels, else oneDNN's), or None."""
    panels = pack_panels(weight)
    return panels if panels is not None else onednn_pack(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """x @ weight.T + bias, through the packed weight when there is one."""
    if packed is not None:
        if packed.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return panel_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def float_kernel_name(dtype: torch.dtype, packed: torch.Tensor | None) -> str:
    """The start-up log's name for a float projection's kernel."""
    name = str(dtype).removeprefix("torch.")
    if packed is None:
        return f"F.linear {name} (not packed)"
    return f"oneDNN packed {name}" if packed.is_mkldnn else f"kvserve {name} panels (AVX-512)"
