"""Executors: run each step's `StepInput` on the worker rank(s) and sample the logits they return.

`make_executor` picks one from the parallel config: UniProcExecutor (one rank, in this
process), MultiprocExecutor (a process per rank), RayExecutor (ranks as Ray actors).
"""

from __future__ import annotations

from kvserve.executor.base import Executor


def make_executor(config, worker_config) -> Executor:
    """The executor for `config.parallel` (an EngineConfig) running `worker_config` ranks."""
    if config.tensor_parallel_size == 1 and config.distributed_executor_backend != "ray":
        from kvserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, worker_config)
    if config.distributed_executor_backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor(config, worker_config)
    from kvserve.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, worker_config)
