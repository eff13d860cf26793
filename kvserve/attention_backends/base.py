"""The attention-backend seam: what the model runner asks of a backend, and how one is chosen.

A backend owns two things for one step: the metadata builder (the step's sequences -> the index
tensors its kernels read, built once per step and shared by every layer) and the forward (write
the new K/V through the slot mapping, then attend). The model runner describes the step in
backend-neutral terms (`ScheduledSeq`: where each request's new tokens start, how many, its
block table, decode or prefill), so the runner never knows a kernel's index layout, and the
layers only hand the metadata back to `meta.backend.forward`.

Two backends exist: `cpu` (today's path, unchanged: the C++ paged decode kernel and PyTorch
prefill, attention.py) and `triton` (the CUDA kernels in triton_kernels/). A CUDA device
selects `triton`, anything else `cpu`; KVSERVE_ATTENTION_BACKEND overrides the choice (tests
run the Triton backend on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class ScheduledSeq:
    """One request's share of a step, as the model runner laid it out (decodes first)."""

    start: int  # tokens already in the KV cache (its first new token's position)
    num_tokens: int  # new tokens this step (for a speculative decode: 1 + drafts)
    block_table: list[int]  # the request's physical blocks, in position order
    is_decode: bool  # decode rows (one query each) vs a prefill chunk


class AttentionBackend(Protocol):
    """What the model runner and PagedAttention call."""

    name: str

    def build_metadata(self, seqs: list[ScheduledSeq], positions: np.ndarray) -> Any:
        """The step's metadata; `positions` are the flat positions of all new tokens, in order."""

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend; rows past the step's tokens (padding) are zeros."""


BACKENDS = ("cpu", "triton")


def backend_name_for(device: torch.device) -> str:
    """cuda -> triton, anything else -> cpu, unless KVSERVE_ATTENTION_BACKEND names one."""
    name = os.environ.get("KVSERVE_ATTENTION_BACKEND") or ("triton" if device.type == "cuda" else "cpu")
    if name not in BACKENDS:
        raise ValueError(f"KVSERVE_ATTENTION_BACKEND: {name!r} is not one of {', '.join(BACKENDS)}")
    return name


def make_backend(device: torch.device, block_size: int, name: str | None = None) -> AttentionBackend:
    """The backend for `device` (imported lazily: the Triton one needs triton)."""
    name = name or backend_name_for(device)
    if name == "triton":
        from kvserve.attention_backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, block_size)
    from kvserve.attention_backends.cpu import CpuAttentionBackend

    return CpuAttentionBackend(device, block_size)
