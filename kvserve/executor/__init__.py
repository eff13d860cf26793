"""Executors: run each step's `StepInput` on the worker rank(s) and sample the logits they return.

`make_executor` picks one from the config's parallel section: UniProcExecutor (one rank, in
this process), MultiprocExecutor (a local process per rank, `mp`) or RayExecutor (a Ray
actor per rank, `ray`).
"""

from __future__ import annotations

from kvserve.executor.base import Executor


def make_executor(config, worker_config) -> Executor:
    """The executor for an EngineConfig whose ranks run `worker_config`."""
    if config.parallel.world_size == 1:
        from kvserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, worker_config)
    if config.parallel.distributed_executor_backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor(config, worker_config)
    from kvserve.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, worker_config)
