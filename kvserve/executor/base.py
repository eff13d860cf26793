"""What the engine core asks of an executor, whatever runs the ranks."""

from __future__ import annotations

import time

from kvserve.core.scheduler import SchedulerOutput
from kvserve.executor.driver_sampler import DriverSampler
from kvserve.executor.step_builder import StepBuilder
from kvserve.model.layers.sampler import SampleResult
from kvserve.worker.step_input import RunnerOutput, StepInput

StepResult = tuple[dict[str, SampleResult], dict[str, list[dict[int, float] | None]], dict[str, list[float]]]


class Executor:
    """Subclasses implement `_run` (send the step to every rank, return rank 0's output),
    `collective_rpc` and `shutdown`."""

    load_time: float = 0.0

    def __init__(self, seed: int) -> None:
        self.builder = StepBuilder()
        self.driver_sampler = DriverSampler(seed)
        self.run_s = 0.0  # time in _run (send, ranks compute, answer back): benchmarks read it
        self.num_steps = 0

    def execute_model(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        """Run one step on the ranks and sample; returns the tokens per request id, the prompt
        logprobs computed this step, and the vectors of embedding requests that finished."""
        step = self.builder.build(sched, block_tables)
        t0 = time.perf_counter()
        out = self._run(step)
        self.run_s += time.perf_counter() - t0
        self.num_steps += 1
        sampled = self.driver_sampler.sample(out, {r.request_id: r for r, _ in sched.scheduled})
        return sampled, out.prompt_logprobs, {rid: v.tolist() for rid, v in out.pooled.items()}

    def _run(self, step: StepInput) -> RunnerOutput:
        raise NotImplementedError

    def collective_rpc(self, method: str) -> list:
        """Call a no-argument Worker method on every rank; their results in rank order."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        pass
