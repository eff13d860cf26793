"""The in-process engine: input processing, the engine core, and output processing.

`step()` is the whole loop body: one engine-core step (schedule, one forward pass, sample),
then detokenization and stop strings, returning outputs for every request that progressed.
The server runs the same three parts with the core in its own process.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import InputProcessor, ModelLimits
from kvserve.outputs import RequestOutput
from kvserve.platform.memory import trim_heap
from kvserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: replicas are a server feature (kvserve serve); use 1 here")
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.processor = InputProcessor(self.tokenizer, limits_of(self.core), config.kv_transfer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []

    # The core's parts, for callers that inspect the engine (tests, benchmarks).
    scheduler = property(lambda self: self.core.scheduler)
    kv_cache_manager = property(lambda self: self.core.kv_cache_manager)
    model_runner = property(lambda self: self.core.model_runner)
    max_model_len = property(lambda self: self.core.max_model_len)
    pool_size = property(lambda self: self.core.pool_size)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    load_time = property(lambda self: self.core.load_time)
    arch = property(lambda self: self.core.arch)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field."""
        params = params or SamplingParams()
        held = self.output_processor.states.get(request_id)
        if held is not None:
            self.processor.release_lease(params, held.params)
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req = self.processor.process(request_id, prompt, params, arrival_time, priority, cache_salt, group_id)
        self.core.add_request(req)
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)

    def abort_request(self, request_ids: str | Sequence[str], report: bool = True) -> None:
        """Stop requests now and free their KV blocks; their final output comes from the next
        step (unless report=False)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        for rid in ids:
            out = self.output_processor.abort(rid)
            if out is not None and report:
                self._pending.append(out)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._pending)

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        results, self._pending = self._pending, []
        core_out = self.core.step()
        outs, to_abort = self.output_processor.process(core_out.outputs)
        self.core.abort_requests(to_abort)
        if core_out.outputs and not self.core.has_unfinished_requests():
            trim_heap()  # idle after a burst: return what its steps freed (platform/memory.py)
        return results + outs


def limits_of(core: EngineCore) -> ModelLimits:
    return ModelLimits(
        core.arch.vocab_size, core.max_model_len, core.pool_size.num_blocks, core.pool_size.block_size
    )
