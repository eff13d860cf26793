"""Dense projections, with oneDNN weight prepacking on CPU.

PyTorch's default CPU matmul repacks the weight matrix on every call; at decode batch
sizes that repacking costs as much as the multiplication. oneDNN can pack a weight once
(at load) into its blocked layout, which measured about 2x faster here for the shapes of
a small decoder (benchmarks/bench_engine.py). On other devices, or if packing is not
supported, the plain `F.linear` path is used. On an AVX-512 CPU without AMX, float32 and
bfloat16 weights take kvserve's own panel layout and kernels instead (float_panels.py: up to
~1.7x oneDNN's speed at decode batch sizes there, level with it for prefills).

bfloat16 through oneDNN runs at most `BF16_INVARIANT_ROWS` rows a call: from 33 rows (K >= ~512)
oneDNN picks another bf16 kernel whose fp32 sums round to other bf16 bits, so a row's result
depended on how many rows shared its step and greedy text moved with batching. Every row count
up to 32 gives each row the same bits (tests/test_linear_batch_invariance.py); past 32 the big
kernels differ among themselves too, so no fixed padding helps. Cost on the AMX host (one thread,
default model's four projections, min of 15 alternating runs, host shared): 1.0x up to 32 rows,
1.7x at 64, 2.4-2.7x from 256 (the 32-row kernel does the work of the wider tiles twice over).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvserve.model.layers.float_panels import pack_panels, panel_linear

logger = logging.getLogger(__name__)

BF16_INVARIANT_ROWS = 32


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
    """x @ weight.T + bias, through the packed weight when there is one; a CPU bfloat16 batch
    in runs of 32 rows, so each row's bits are the same in any batch."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and (packed is None or packed.is_mkldnn):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > BF16_INVARIANT_ROWS:
            flat = x.reshape(rows, x.shape[-1])
            parts = [_linear(part, weight, bias, packed) for part in flat.split(BF16_INVARIANT_ROWS)]
            return torch.cat(parts).reshape(*x.shape[:-1], -1)
    return _linear(x, weight, bias, packed)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
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
