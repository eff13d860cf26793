"""The engine core: scheduler + model runner, one forward pass per `step()`.

It works on token ids only. Text (tokenizing, detokenizing, stop strings) lives on the
caller's side, so the same core runs in-process for the offline `LLM` and in its own
process behind the server.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import torch

from kvserve.config import EngineConfig
from kvserve.core.block_pool import KVEvents
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_sizing import (
    KVPoolSize,
    gpu_kv_budget,
    kv_bytes_per_token,
    kv_cache_element_bytes,
    kv_pool_size,
    parse_memory_size,
)
from kvserve.core.pipelined_scheduler import PipelinedScheduler
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.distributed.parallel_state import pipeline_layers
from kvserve.engine.beam_search import BeamSearchManager
from kvserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from kvserve.engine.sample_groups import SampleGroups
from kvserve.engine.step_recovery import recover_failed_step
from kvserve.executor import make_executor
from kvserve.executor.device_sampling import DeviceSamplingPlanner, device_sampling_enabled
from kvserve.model.arch import ModelArch
from kvserve.model.layers.tp_sharding import check_tensor_parallel, max_local_kv_heads
from kvserve.model.loader import load_arch, load_tokenizer, resolve_model, resolve_tokenizer
from kvserve.model.loader.tokenizer_loader import check_tokenizer_fits
from kvserve.platform.cpu_isa import cpu_compute_dtype
from kvserve.request import Request, RequestStatus
from kvserve.spec_decode.adaptive import SpecState
from kvserve.spec_decode.draft import DraftModelProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.structured.compiling import CompilingRequests
from kvserve.tokenizer import Tokenizer
from kvserve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"


def kv_pool_for(
    config: EngineConfig, arch: ModelArch, budget_bytes: int, draft_arch: ModelArch | None = None
) -> KVPoolSize:
    """The pool a budget buys for this model (and its draft model, whose KV shares the block
    tables, so each token costs both); `kvserve plan` uses the same arithmetic."""
    elem, scale = kv_cache_element_bytes(config.kv_cache_dtype, config.dtype)
    per_token = sum(
        kv_bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim, elem, scale)
        for a in (arch, draft_arch)
        if a is not None
    )
    return kv_pool_size(budget_bytes, config.block_size, per_token)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        # bf16 without hardware support is several times slower than fp32: compute in fp32.
        dtype = cpu_compute_dtype(config.dtype, config.torch_device.type)
        if dtype != config.dtype:
            config = replace(config, dtype=dtype)
        self.config = config
        self.source = resolve_model(config.model)
        device = config.torch_device
        arch = self.arch = load_arch(self.source)
        self.tokenizer_source = resolve_tokenizer(config.model, config.tokenizer)
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        if config.tokenizer is not None:
            check_tokenizer_fits(config.tokenizer, self.tokenizer, arch.vocab_size)
        tp = config.tensor_parallel_size
        check_tensor_parallel(arch, tp)
        draft_arch = self._check_draft() if config.speculative_method == "draft" else None
        context = arch.max_position_embeddings
        if draft_arch is not None:
            context = min(context, draft_arch.max_position_embeddings)
        window = arch.sliding_window
        if window is not None and window < context:
            context = window  # past the window full attention is no longer the model's attention
        self.max_model_len = config.max_model_len or context
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}"
            )
        if draft_arch is not None and self.max_model_len > draft_arch.max_position_embeddings:
            # The draft runs every position the target does: past its rotary tables each such
            # step failed its requests (an IndexError per step, logged with its stack).
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the draft model's context length "
                f"{draft_arch.max_position_embeddings} (speculative_model)"
            )
        if window is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's sliding attention window "
                f"{window}, which kvserve does not implement (beyond it outputs would not be the model's)"
            )
        pp = config.pipeline_parallel_size
        if pp > arch.num_layers:
            raise ValueError(f"pipeline_parallel_size: {pp} stages for {arch.num_layers} layers")
        budget = self._kv_budget(device)  # per rank; every rank's pool has the same blocks
        # The largest rank: the most KV heads, and under pipeline parallelism the most layers.
        rank_layers = pipeline_layers(arch.num_layers, pp, 0)[1]
        rank_arch = replace(arch, num_kv_heads=max_local_kv_heads(arch, tp), num_layers=rank_layers)
        self.pool_size = kv_pool_for(config, rank_arch, budget, draft_arch)
        if self.pool_size.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: too small for one KV block ({self.pool_size.block_bytes} bytes)"
            )
        self.kv_cache_manager = KVCacheManager(
            self.pool_size.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if pp > 1:  # one batch stream per stage, so the stages overlap (core/pipelined_scheduler.py)
            self.scheduler = PipelinedScheduler(
                self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                self.max_model_len, config.scheduling_policy, pp,
            )  # fmt: skip
        else:
            self.scheduler = Scheduler(
                self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                config.scheduling_policy, config.long_prefill_token_threshold,
            )  # fmt: skip
        self._in_flight: list[tuple[int, SchedulerOutput]] = []  # (stream, step) under PP
        self.beams = BeamSearchManager(self.scheduler)
        self.samples = SampleGroups(self.scheduler)
        self.executor = make_executor(config, self._worker_config())
        if device_sampling_enabled(device):  # CUDA: sample on the device (executor/device_sampling.py)
            self.executor.device_sampling = DeviceSamplingPlanner(arch.vocab_size)
        self.connector = self._make_connector()
        # A GGUF tokenizer's eos is the file's tokenizer.ggml.eos_token_id, already in
        # arch.eos_token_ids; an HF directory's tokenizer may name another (tokenizer_config.json).
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer_source.kind == "hf" else None
        self.load_time = time.perf_counter() - t0  # reading + dequantizing weights (HF: tokenizer)
        self.proposer = self._make_proposer()
        self.eos_token_ids = frozenset(arch.eos_token_ids) | (
            {tokenizer_eos} if tokenizer_eos is not None else set()
        )
        # [structured outputs] requests wait here until their grammar is compiled
        self.compiling = CompilingRequests(lambda: self.tokenizer, arch.vocab_size, self.eos_token_ids)
        p = self.pool_size
        logger.info(
            "model %s loaded in %.1fs (%s, %s, tensor_parallel_size=%d, pipeline_parallel_size=%d); "
            "KV pool per rank: %d blocks x %d "
            "tokens = %d tokens, %.1f MiB; max concurrency at max_model_len=%d: %.2f",
            self.source.name, self.load_time, config.dtype, device, tp, pp, p.num_blocks, p.block_size,
            p.num_tokens, p.total_bytes / 2**20, self.max_model_len, p.max_concurrency(self.max_model_len),
        )  # fmt: skip
        if config.speculative_method:
            draft = f" ({config.speculative_model})" if config.speculative_model else ""
            logger.info(
                "speculative decoding: %s%s, up to %d tokens per step",
                config.speculative_method, draft, config.num_speculative_tokens,
            )  # fmt: skip
        if config.quantization:
            per_rank = self.executor.collective_rpc("weight_bytes")
            logger.info(
                "weights: %s, %s MiB per rank", config.quantization, [round(b / 2**20, 1) for b in per_rank]
            )
        if config.kv_cache_dtype != "auto":
            plain = kv_pool_for(replace(config, kv_cache_dtype="auto"), arch, budget, draft_arch)
            ratio = p.num_tokens / max(plain.num_tokens, 1)
            logger.info(
                "KV cache %s (1 byte per element + a bf16 scale per token and head): %.2fx the tokens "
                "of a %s cache in the same memory", config.kv_cache_dtype, ratio, config.dtype,
            )  # fmt: skip

    def _make_connector(self):
        """Prefill/decode disaggregation (kv_transfer/): the connector over this engine's KV pool."""
        kt = self.config.kv_transfer
        if kt is None:
            return None
        if self.model_runner is None or self.config.speculative_method == "draft":
            raise ValueError(
                "kv_transfer_config: needs tensor_parallel_size 1, pipeline_parallel_size 1 and "
                "no draft model"
            )
        from kvserve.kv_transfer.block_io import KVBlockIO
        from kvserve.kv_transfer.factory import make_connector

        c = self.config
        identity = f"{self.source.name}|{c.dtype}|{c.quantization}|{c.kv_cache_dtype}"
        connector = make_connector(kt, KVBlockIO.from_runner(self.model_runner, identity), c.block_size)
        self.scheduler.connector = connector
        logger.info(
            "kv transfer: connector %s, role %s, engine id %s",
            kt.kv_connector,
            kt.kv_role,
            connector.engine_id,
        )
        return connector

    def poll_transfers(self) -> bool:
        """Between steps: free lease blocks that were sent or expired, write finished fetches
        into their blocks (or send their requests to compute the prompt). True if anything
        changed."""
        c = self.connector
        if c is None:
            return False
        kv = self.kv_cache_manager
        released = c.drain_released()
        for blocks in released:
            kv.free_blocks(blocks)
        loads = c.take_loads()
        for result in loads:
            req = self.scheduler.waiting_for_kv.get(result.request.request_id)
            if req is not result.request:
                continue  # aborted while on the way
            ok = result.payload is not None
            if ok:
                table = kv.get_block_ids(req.request_id)
                try:
                    c.write(result, table[result.first_block : result.first_block + result.num_blocks])
                except ValueError as e:
                    logger.warning("kv transfer for %s: %s; computing its prompt here", req.request_id, e)
                    ok = False
            self.scheduler.finish_remote_load(req, ok)
        return bool(released or loads)

    @property
    def tokenizer(self) -> Tokenizer:
        """Built on first use: the core needs it only to compile grammars (in a compile thread)
        and, for an HF directory, for its eos id. A GGUF's took ~1-1.4 s of each start
        (transformers' import and the vocabulary's conversion) for a server that may never see
        a grammar; the API process builds its own."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.tokenizer_source)
            return self._tokenizer

    def has_pending_transfers(self) -> bool:
        """Leases held or fetches running: an idle core must keep polling (poll_transfers)."""
        return self.connector is not None and self.connector.has_pending()

    def _check_draft(self) -> ModelArch:
        """The draft model's shape; it must speak the target's tokenizer (same vocabulary)."""
        source = resolve_model(self.config.speculative_model)
        draft_arch, draft_tok = load_arch(source), load_tokenizer(source)
        ours, theirs = self.tokenizer.backend.get_vocab(), draft_tok.backend.get_vocab()
        # Every token of ours must mean the same id there (the draft may add special tokens).
        if draft_arch.vocab_size != self.arch.vocab_size or any(theirs.get(t) != i for t, i in ours.items()):
            raise ValueError(
                f"speculative_model: {self.config.speculative_model!r} does not share the target's tokenizer"
            )
        return draft_arch

    def _worker_config(self) -> WorkerConfig:
        c = self.config
        dtype = "float32" if c.torch_dtype == torch.float32 else "bfloat16"
        return WorkerConfig(
            self.source.path, dtype, str(c.torch_device),
            self.pool_size.num_blocks, c.block_size, c.kv_cache_dtype, c.quantization,
            resolve_model(c.speculative_model).path if c.speculative_model else None, c.tensor_parallel_size,
            c.pipeline_parallel_size, enforce_eager=c.enforce_eager, max_num_seqs=c.max_num_seqs,
            max_model_len=self.max_model_len, seed=c.seed,
        )  # fmt: skip

    @property
    def model_runner(self):
        """The in-process model runner (tests and benchmarks); None when ranks run elsewhere."""
        return getattr(self.executor, "model_runner", None)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        self.executor.shutdown()

    def _make_proposer(self):
        method = self.config.speculative_method
        if method == "ngram":
            return NgramProposer(self.config.speculative_ngram_min, self.config.speculative_ngram_max)
        if method == "draft":
            self.scheduler.num_lookahead_slots = self.config.num_speculative_tokens
            return DraftModelProposer(self.model_runner, self.kv_cache_manager)  # one rank, in-process
        return None

    def _propose(self, progressed: list[Request]) -> None:
        """Set next step's proposals for requests that are decoding (and may speculate)."""
        k_max = self.config.num_speculative_tokens
        items = []
        for req in progressed:
            if req.is_finished:
                continue
            if req.spec_state is None:
                req.spec_state = SpecState(k_max)
            # The verified run plus the target's token must fit max_tokens and max_model_len.
            room = min(req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
            k = min(room, req.spec_state.num_to_propose()) if room > 0 else 0
            if k > 0:
                items.append((req, k))
        if not items:  # (Scheduler.update already cleared the proposals these requests ran with)
            return
        try:
            proposals = self.proposer.propose(items)
        except Exception:  # noqa: BLE001 - speculation is an optimisation: go on without it
            logger.exception("the speculative proposer failed; these requests decode without proposals")
            return
        for rid, tokens in proposals.items():
            req = self.scheduler.requests[rid]
            if req.grammar is not None and tokens:  # [structured outputs] no draft it refuses
                tokens = tokens[: req.grammar.valid_prefix(tokens)]
            req.spec_token_ids = tokens

    def _kv_budget(self, device) -> int:
        if self.config.kv_cache_memory is not None:
            return parse_memory_size(self.config.kv_cache_memory)
        if device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(device)
            # The same rule as `kvserve plan`: utilization x memory, less what is already used
            # (the weights), less an overhead share for activations and fragmentation, less the
            # decode CUDA graphs' pool (worker/cuda_graphs.py) unless --enforce-eager.
            budget = gpu_kv_budget(total, self.config.gpu_memory_utilization, total - free)
            return max(budget - self._graph_pool_bytes(), 0)
        return parse_memory_size(DEFAULT_CPU_KV_CACHE_MEMORY)

    def _graph_pool_bytes(self) -> int:
        """What the decode CUDA graphs will take (0 with --enforce-eager or several ranks)."""
        c, a = self.config, self.arch
        if c.enforce_eager or c.tensor_parallel_size * c.pipeline_parallel_size > 1:
            return 0
        from kvserve.worker.cuda_graphs import graph_pool_bytes_estimate

        elem = 4 if c.torch_dtype == torch.float32 else 2
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return graph_pool_bytes_estimate(
            c.max_num_seqs, a.hidden_size, a.intermediate_size, q_size, kv_size, a.num_heads, elem
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        if (
            req.request_id in self.scheduler.requests
            or req.request_id in self.compiling
            or self.beams.owns(req.request_id)
            or req.request_id in self.samples.held
        ):
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        seats = self.scheduler.max_num_seqs  # per batch stream under pipeline parallelism
        if req.params.use_beam_search and req.params.n > seats:
            raise ValueError(f"n: {req.params.n} beams can never run at once (seats for one group: {seats})")
        request = Request(
            req.request_id, req.prompt_token_ids, req.params, req.max_tokens, self.eos_token_ids,
            req.arrival_time, req.priority, req.cache_salt, req.group_id,
        )  # fmt: skip
        if req.params.use_beam_search:
            self.beams.add(request)  # a beam group's result slot; the first one starts the search
        elif req.params.structured_outputs is not None:
            self.compiling.add(request)  # [structured outputs] the scheduler gets it once compiled
        elif self.samples.forkable(request):
            self.samples.add(request)  # n > 1: siblings fork from the first once its prompt is done
        else:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Free the requests' blocks now; no output is produced for them."""
        for rid in request_ids:
            if self.beams.owns(rid):
                self.beams.abort(rid)
            elif (compiling := self.compiling.abort(rid)) is not None:
                self._release_unpulled(compiling)
            elif not self.samples.abort(rid):
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        self.samples.promote_orphans()

    def has_unfinished_requests(self) -> bool:
        # A step still in the pipe (its requests perhaps aborted since) must be collected.
        return (
            self.scheduler.has_unfinished_requests() or bool(self.compiling) or self.beams.has_pending()
            or bool(self.samples.held) or bool(self._in_flight)
        )  # fmt: skip

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """[structured outputs] Hand requests whose grammar is ready to the scheduler; end failed ones."""
        if not self.compiling:
            return []
        if not self.scheduler.has_unfinished_requests():
            self.compiling.wait(0.01)  # nothing else to run: sleep instead of spinning
        ready, failed = self.compiling.pop_ready()
        for req in ready:
            self.scheduler.add_request(req)
        for req in failed:
            self._release_unpulled(req)
        return [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in failed]

    def _release_unpulled(self, req: Request) -> None:
        """A request that ends before the scheduler saw it: a producer's lease for its prompt
        (prefill/decode disaggregation) is freed now, not when it expires."""
        if self.connector is not None:
            self.connector.cancel(req)

    def enable_kv_events(self) -> None:
        """Publish prefix-cache changes with every step's outputs (for a cache-aware router)."""
        self.kv_cache_manager.pool.events = KVEvents()

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; returns how many blocks were uncached."""
        return self.kv_cache_manager.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        if isinstance(self.scheduler, PipelinedScheduler):
            return self._step_pipelined()
        outputs: list[EngineCoreOutput] = self._admit_compiled()
        self.poll_transfers()
        sched = self.scheduler.schedule()
        if not sched and self.scheduler.waiting_for_kv:
            self.connector.wait_for_loads(0.005)  # nothing to run until a fetch lands: do not spin
        if sched:
            block_tables = {
                r.request_id: self.kv_cache_manager.get_block_ids(r.request_id) for r, _ in sched.scheduled
            }
            try:
                sampled, prompt_logprobs, pooled = self.executor.execute_model(sched, block_tables)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                outputs += recover_failed_step(self, sched, block_tables, e)
                return self._outputs(outputs, sched)
            self._apply_step(sched, sampled, prompt_logprobs, pooled, outputs)
        return self._outputs(outputs, sched)

    def _apply_step(
        self, sched: SchedulerOutput, sampled, prompt_logprobs, pooled, outputs, stream: int | None = None
    ) -> None:
        """Hand a step's results to the scheduler (of `stream` under pipeline parallelism) and
        append the outputs."""
        for req, _ in sched.scheduled:
            entries, ranks = prompt_logprobs.get(req.request_id, ((), ()))
            if entries:
                # After a preemption the prompt is recomputed in chunks that need not line
                # up with the first attempt's: keep only positions not recorded yet.
                skip = (len(req.prompt_logprobs) - 1) - req.num_computed_tokens
                if 0 <= skip < len(entries):
                    req.prompt_logprobs.extend(entries[skip:])
                    req.prompt_logprob_ranks.extend(ranks[skip:])
        self.beams.collect(sampled)  # beam candidates, not tokens: the groups choose
        self.samples.fork_followers(sched, sampled)
        if stream is None:
            progressed = self.scheduler.update(sched, sampled)
        else:
            progressed = self.scheduler.update(stream, sched, sampled)
        for req, count in progressed:
            outputs.append(self._output(req, count))
        outputs += self.beams.advance()
        for rid, vector in pooled.items():  # embedding requests end with their prompt
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.first_token_time = time.monotonic()
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                out = self._output(req, 0)
                out.embedding = vector
                outputs.append(out)
        if self.proposer is not None:
            self._propose([req for req, _ in progressed])

    def _step_pipelined(self) -> EngineCoreOutputs:
        """Pipeline parallelism: send the next free stream's step, and collect the oldest step
        once every stage has one (or nothing new could be sent). So a call usually returns
        the tokens of the step sent `pipeline_parallel_size - 1` calls earlier. A failed step
        is not retried request by request (the other steps in flight would be answered out of
        order): it ends the engine like a dead rank."""
        outputs: list[EngineCoreOutput] = self._admit_compiled()
        sched = SchedulerOutput()
        busy = {i for i, _ in self._in_flight}
        streams = self.scheduler.streams
        for k in range(len(streams)):  # the next stream in turn with no step in flight
            i = (self.scheduler.next_stream + k) % len(streams)
            if i in busy:
                continue
            sched = self.scheduler.schedule_stream(i)
            if sched:
                self.scheduler.next_stream = (i + 1) % len(streams)
                kv = self.kv_cache_manager
                block_tables = {r.request_id: kv.get_block_ids(r.request_id) for r, _ in sched.scheduled}
                self.executor.submit(sched, block_tables)
                self._in_flight.append((i, sched))
                break
        if self._in_flight and (len(self._in_flight) == len(streams) or not sched):
            i, done = self._in_flight.pop(0)
            sampled, prompt_logprobs, pooled = self.executor.collect()
            self._apply_step(done, sampled, prompt_logprobs, pooled, outputs, stream=i)
        return self._outputs(outputs, sched)

    def _outputs(self, outputs: list[EngineCoreOutput], sched) -> EngineCoreOutputs:
        """This step's outputs with the scheduler's numbers (for metrics)."""
        outputs = self.beams.translate(outputs) + self.beams.drain()
        self.samples.promote_orphans()  # after a failed step
        spec = self.scheduler.spec_stats
        events = self.kv_cache_manager.pool.events
        stored, removed, cleared = events.drain() if events is not None else ([], [], False)
        return EngineCoreOutputs(
            outputs,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting)
            + len(self.compiling)
            + len(self.scheduler.waiting_for_kv),
            kv_cache_usage=self.kv_cache_manager.usage(),
            **self._background_load(),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            iteration_tokens=sched.total_tokens,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
            kv_stored=stored,
            kv_removed=removed,
            kv_cleared=cleared,
            **self._transfer_totals(),
        )

    def _background_load(self) -> dict:
        """The batch lines' share of the load (they yield to interactive requests, so an
        autoscaler must not count them); sent only when there are any."""
        out = {}
        if bg := [r for r in self.scheduler.running if r.background]:  # (a step's newcomers come after it)
            blocks = sum(len(self.kv_cache_manager.get_block_ids(r.request_id)) for r in bg)
            out["num_running_background"] = len(bg)
            out["kv_cache_usage_background"] = blocks / max(1, self.kv_cache_manager.num_blocks)
        if n := self.scheduler.num_waiting_background():  # (a pipeline's: its streams' sum)
            out["num_waiting_background"] = n
        return out

    def _transfer_totals(self) -> dict:
        if self.connector is None:
            return {}
        s = self.connector.stats
        return {
            "kv_transfers": s.loads, "kv_transfer_failures": s.load_failures,
            "kv_transfer_bytes": s.load_bytes, "kv_transfer_seconds": s.load_seconds,
            "kv_leases_expired": s.leases_expired,
        }  # fmt: skip

    @staticmethod
    def _output(req: Request, count: int) -> EngineCoreOutput:
        first = len(req.output_token_ids) == count
        out = EngineCoreOutput(req.request_id, req.output_token_ids[len(req.output_token_ids) - count :])
        if req.params.logprobs is not None:  # (count may be 0: a request ended with no new token)
            out.new_logprobs = req.logprobs[len(req.logprobs) - count :]
            out.new_logprob_ranks = req.logprob_ranks[len(req.logprob_ranks) - count :]
        if first:
            out.first_scheduled_time = req.first_scheduled_time
            out.first_token_time = req.first_token_time
            out.num_cached_tokens = req.num_cached_tokens
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs = req.prompt_logprobs
                out.prompt_logprob_ranks = req.prompt_logprob_ranks
        if req.is_finished:
            out.kv_transfer_params = req.kv_transfer_out
            out.finish_reason = req.finish_reason
            out.stop_reason = req.stop_reason
            # An error a step's own result ends a request with is its parameters' (a 400): the
            # engine's failures end theirs in step_recovery.py, not here.
            out.refused = req.status is RequestStatus.FINISHED_ERROR
            out.stopped_on_token = req.stopped_on_token
            out.finished_time = req.finished_time
            out.num_preemptions = req.num_preemptions
        return out
