"""One rank in the engine's own process: the step goes to the worker as a Python object,
nothing is serialized or copied (the single-process path as fast as before executors)."""

from __future__ import annotations

from kvserve.executor.base import Executor
from kvserve.worker.step_input import RunnerOutput, StepInput
from kvserve.worker.worker import Worker, WorkerConfig


class UniProcExecutor(Executor):
    def __init__(self, config, worker_config: WorkerConfig) -> None:
        super().__init__(config.seed)
        self.worker = Worker(worker_config, rank=0)
        self.load_time = self.worker.load_time

    @property
    def model_runner(self):
        return self.worker.model_runner

    def _send(self, step: StepInput) -> None:
        self._step = step  # one at a time: a single rank has no pipeline to fill

    def _receive(self) -> RunnerOutput:
        step, self._step = self._step, None
        return self.worker.execute_model(step)

    def collective_rpc(self, method: str) -> list:
        return [getattr(self.worker, method)()]
