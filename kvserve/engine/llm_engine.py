"""The in-process engine: validates requests, runs scheduler → model runner → update steps.

`step()` is the whole loop body: schedule, execute one forward pass, append sampled tokens,
detokenize, apply stop strings, and return outputs for every request that progressed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_sizing import KVPoolSize, kv_bytes_per_token, kv_pool_size, parse_memory_size
from kvserve.core.scheduler import Scheduler
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.model.arch import ModelArch
from kvserve.model.loader import load_model, resolve_model
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"


def kv_pool_for(config: EngineConfig, arch: ModelArch, budget_bytes: int) -> KVPoolSize:
    """The pool a budget buys for this model; `kvserve plan` uses the same arithmetic."""
    dtype_bytes = config.torch_dtype.itemsize
    per_token = kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype_bytes)
    return kv_pool_size(budget_bytes, config.block_size, per_token)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.source = resolve_model(config.model)
        device = config.torch_device
        self.model, self.tokenizer = load_model(self.source, config.torch_dtype, device)
        arch = self.arch = self.model.arch
        self.load_time = time.perf_counter() - t0

        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}"
            )
        self.pool_size = kv_pool_for(config, arch, self._kv_budget(device))
        if self.pool_size.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: too small for one KV block ({self.pool_size.block_bytes} bytes)"
            )
        self.kv_cache_manager = KVCacheManager(self.pool_size.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.model_runner = ModelRunner(
            self.model, self.pool_size.num_blocks, config.block_size, device, config.seed
        )
        self.eos_token_ids = frozenset(arch.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._finished_outside_step: list[Request] = []
        p = self.pool_size
        logger.info(
            "model %s loaded in %.1fs (%s, %s); KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB; "
            "max concurrency at max_model_len=%d: %.2f",
            self.source.name, self.load_time, config.dtype, device, p.num_blocks, p.block_size,
            p.num_tokens, p.total_bytes / 2**20, self.max_model_len, p.max_concurrency(self.max_model_len),
        )  # fmt: skip

    def _kv_budget(self, device) -> int:
        if self.config.kv_cache_memory is not None:
            return parse_memory_size(self.config.kv_cache_memory)
        if device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            # Leave room for activations of one full step (logits dominate at large vocab).
            reserve = (
                4 * self.config.max_num_batched_tokens * (self.arch.hidden_size * 16 + self.arch.vocab_size)
            )
            return max(0, int(total * self.config.gpu_memory_utilization) - used - reserve)
        return parse_memory_size(DEFAULT_CPU_KV_CACHE_MEMORY)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the bad field."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text = None
        if isinstance(prompt, str):
            text = prompt
            if not prompt:
                raise ValueError("prompt: must not be empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            vocab = self.arch.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        need = self.kv_cache_manager.blocks_needed(n + max_tokens)
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens need {need} KV blocks but the pool has only "
                f"{self.kv_cache_manager.num_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        if params.n != 1:
            raise ValueError("n: the engine takes one sequence per request; LLM.generate fans n out")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= int(t) < self.arch.vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token ids out of range: {bad[:5]}")
        req = Request(request_id, prompt_ids, params, max_tokens, self.eos_token_ids, arrival_time, text)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now and free their KV blocks; their final output comes from the next step."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._finished_outside_step.append(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._finished_outside_step)

    # ---- the loop body --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(r) for r in self._finished_outside_step]
        self._finished_outside_step.clear()
        sched = self.scheduler.schedule()
        if not sched:
            return outputs
        block_tables = {
            r.request_id: self.kv_cache_manager.get_block_ids(r.request_id) for r, _ in sched.scheduled
        }
        sampled, prompt_logprobs = self.model_runner.execute(sched, block_tables)
        for req, _ in sched.scheduled:
            entries = prompt_logprobs.get(req.request_id)
            # After a preemption the prompt is recomputed; keep the first copy only.
            if entries and len(req.prompt_logprobs) == req.num_computed_tokens + 1:
                req.prompt_logprobs.extend(entries)
        for req in self.scheduler.update(sched, sampled):
            stop = self._detok[req.request_id].update(req.output_token_ids)
            if stop is not None:
                if not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
            outputs.append(self._output(req))
        return outputs

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        detok = self._detok[req.request_id]
        delta = detok.release(finished)
        if finished:
            del self._detok[req.request_id]
        sent, req.num_output_sent = req.num_output_sent, len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=detok.text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            delta_text=delta,
            delta_token_ids=req.output_token_ids[sent:],
        )
        metrics = RequestMetrics(
            req.arrival_time,
            req.first_scheduled_time,
            req.first_token_time,
            req.finished_time,
            req.num_preemptions,
        )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [completion],
            finished,
            metrics,
            req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )
