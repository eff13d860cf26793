"""What the engine core asks of an executor, whatever runs the ranks."""

from __future__ import annotations

import time
from collections import deque

from kvserve.core.scheduler import SchedulerOutput
from kvserve.executor.device_sampling import DeviceSamplingPlanner
from kvserve.executor.driver_sampler import DriverSampler
from kvserve.executor.step_builder import StepBuilder
from kvserve.model.layers.sampler import SampleResult
from kvserve.worker.step_input import RunnerOutput, StepInput

# A request's prompt logprobs computed in a step: the entries, and each prompt token's rank.
PromptLogprobs = tuple[list[dict[int, float] | None], list[int]]
StepResult = tuple[dict[str, SampleResult], dict[str, PromptLogprobs], dict[str, list[float]]]


class Executor:
    """Subclasses implement `_send` (hand a step to every rank), `_receive` (the answering
    rank's output of the oldest step sent), `collective_rpc` and `shutdown`. Steps are
    answered in the order they were sent; under pipeline parallelism the engine keeps
    several in flight (`submit` ... `collect`), otherwise `execute_model` does both."""

    load_time: float = 0.0
    device_sampling: DeviceSamplingPlanner | None = None  # set by the engine (executor/device_sampling.py)

    def __init__(self, seed: int) -> None:
        self.builder = StepBuilder()
        self.driver_sampler = DriverSampler(seed)
        self.run_s = 0.0  # time from sending a step to its answer (benchmarks read it)
        self.num_steps = 0
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self.max_in_flight = 0  # the most steps ever in flight at once (tests read it)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def execute_model(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        """Run one step on the ranks and sample; returns the tokens per request id, the prompt
        logprobs computed this step, and the vectors of embedding requests that finished."""
        self.submit(sched, block_tables)
        return self.collect()

    def submit(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:
        """Send a step without waiting for it (its requests must not be scheduled again
        before it is collected)."""
        step = self.builder.build(sched, block_tables)
        if self.device_sampling is not None:
            step.device_sampling = self.device_sampling.plan(sched)
        self._in_flight.append((sched, time.perf_counter()))
        self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
        self._send(step)

    def collect(self) -> StepResult:
        """Wait for the oldest step in flight and sample its logits."""
        sched, t0 = self._in_flight.popleft()
        out = self._receive()
        self.run_s += time.perf_counter() - t0
        self.num_steps += 1
        sampled = self.driver_sampler.sample(out, {r.request_id: r for r, _ in sched.scheduled})
        ranks = out.prompt_logprob_ranks
        prompt_lp = {rid: (entries, ranks.get(rid, [])) for rid, entries in out.prompt_logprobs.items()}
        return sampled, prompt_lp, {rid: v.tolist() for rid, v in out.pooled.items()}

    def _send(self, step: StepInput) -> None:
        raise NotImplementedError

    def _receive(self) -> RunnerOutput:
        raise NotImplementedError

    def collective_rpc(self, method: str) -> list:
        """Call a no-argument Worker method on every rank; their results in rank order."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        pass
