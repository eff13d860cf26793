"""One start-up line saying what the CPU has and which kernel each compute path runs.

Performance on a CPU depends on the instruction set more than on anything the user sets
(bf16 is 2x faster than fp32 with AMX and several times slower without avx512_bf16), so the
log states the facts a slow deployment is diagnosed from: the flags found and, per path,
the kernel actually chosen for the loaded model (read back from its layers, not assumed).
"""

from __future__ import annotations

import logging

import torch

from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.platform import cpu_isa as isa_mod
from kvserve.platform.cpu_isa import CpuIsa

logger = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_kernels(model: LlamaForCausalLM, attention_kernel: bool) -> dict[str, str]:
    """Path -> kernel for this model as loaded (projections, lm_head, decode attention)."""
    layer = model.layers[0] if len(model.layers) else None
    paths: dict[str, str] = {}
    if layer is not None:
        paths["projections"] = layer.qkv_proj.kernel_name()
    if model.lm_head is not None:
        paths["lm_head"] = model.lm_head.kernel_name()
    attention = "C++ paged kernel (-march=native)" if attention_kernel else "PyTorch gather + SDPA"
    paths["decode attention"] = attention
    paths["compute dtype"] = _dtype_name(model.dtype)
    return paths


def log_kernels(model: LlamaForCausalLM, attention_kernel: bool, isa: CpuIsa | None = None) -> str:
    """Log (and return) the line: CPU flags, then each path's kernel."""
    isa = isa or isa_mod.cpu_isa()  # looked up per call, so tests can patch it
    paths = "; ".join(f"{k}: {v}" for k, v in describe_kernels(model, attention_kernel).items())
    line = f"CPU flags: {isa.describe()} (native bf16: {'yes' if isa.native_bf16 else 'no'}); {paths}"
    logger.info(line)
    return line
