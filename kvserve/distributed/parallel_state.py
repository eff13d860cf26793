"""This process's place in the tensor-parallel group and the pipeline, and the collectives
the model calls.

One group of each per process, set once by the worker before the model is built
(`init_tensor_parallel`). With a group of one (the default, and the in-process engine) every
collective is the identity, so single-process code pays nothing for it. Pipeline stages
(tensor-parallel size 1 under pipeline parallelism: one rank per stage, rank = stage) pass
activations with point-to-point send / recv. Collectives run with the timeout given at init: a
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


@dataclass
class PipelineGroup:
    stage: int = 0
    size: int = 1
    comm_s: float = 0.0  # time blocked in send / recv (benchmarks read it)
    _pending_send: object = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return pipeline_layers(num_layers, self.size, self.stage)

    def send_next(self, x: torch.Tensor) -> None:
        """Hand activations to the next stage without waiting for it to take them (so this
        stage can start its next micro-batch); the previous send is completed first."""
        self.wait_send()
        x = x.contiguous()
        self._pending_send = (dist.isend(x, self.stage + 1), x)

    def wait_send(self) -> None:
        if self._pending_send is not None:
            t0 = time.perf_counter()
            self._pending_send[0].wait()
            self.comm_s += time.perf_counter() - t0
            self._pending_send = None

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        t0 = time.perf_counter()
        dist.recv(x, self.stage - 1)
        self.comm_s += time.perf_counter() - t0
        return x


def pipeline_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Decoder layers [start, stop) of `stage` out of `pp`: contiguous, the first
    `num_layers % pp` stages one longer."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


_group = TensorParallelGroup()
_pp_group = PipelineGroup()


def get_tp_group() -> TensorParallelGroup:
    return _group


def get_pp_group() -> PipelineGroup:
    return _pp_group


def init_tensor_parallel(
    rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 30.0, pp: int = 1
) -> TensorParallelGroup:
    """Join the process group (rendezvous at `init_method`, e.g. tcp://127.0.0.1:port). With
    `pp` > 1 (and `size` 1) the ranks are pipeline stages, rank = stage."""
    global _group, _pp_group
    if size > 1 and pp > 1:
        raise ValueError("tensor and pipeline parallelism together are not supported yet")
    if size * pp > 1:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size * pp,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    _group = TensorParallelGroup(rank if pp == 1 else 0, size)
    _pp_group = PipelineGroup(rank if pp > 1 else 0, pp)
    return _group


def destroy_tensor_parallel() -> None:
    global _group, _pp_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
    _pp_group = PipelineGroup()
