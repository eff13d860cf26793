"""This process's place in the tensor-parallel group, and the collectives the model calls.

One group per process, set once by the worker before the model is built (`init_tensor_parallel`).
With a group of one (the default, and the in-process engine) every collective is the identity,
so single-process code pays nothing for it. Collectives run with the timeout given at init: a
rank that hangs turns into an error on the others instead of a silent stall.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    collective_s: float = 0.0  # time spent in collectives (benchmarks/bench_parallel.py reads it)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that returns logits to the engine."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(x)
            self.collective_s += time.perf_counter() - t0
        return x

    def gather_last_dim(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's [n, widths[rank]] piece along the last dim on rank 0 (gloo
        gathers equal shapes, so pieces travel padded to the widest); other ranks get None."""
        if self.size == 1:
            return x
        width = max(widths)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        t0 = time.perf_counter()
        dist.gather(x, parts, dst=0)
        self.collective_s += time.perf_counter() - t0
        if not self.is_driver:
            return None
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _group


def init_tensor_parallel(
    rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 30.0
) -> TensorParallelGroup:
    """Join the process group (rendezvous at `init_method`, e.g. tcp://127.0.0.1:port)."""
    global _group
    if size > 1:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    _group = TensorParallelGroup(rank, size)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
