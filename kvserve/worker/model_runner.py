"""Turns one step's `StepInput` into tensors, runs the model once, and returns the logits to
sample (the engine samples them: see worker/step_input.py), or, for the rows the engine listed
for sampling on the device, their token ids (worker/device_sampling.py). On a pipeline stage
it runs that stage's layers: stages after the first receive the residual stream for the step's
rows from the previous stage, stages before the last send theirs on and return nothing.

Owns the KV pool tensor (this rank's heads under tensor parallelism) and a mirror of the
requests it runs, updated from each step's deltas. Per step it builds flat input ids and
positions (all requests' new tokens concatenated, decodes first), the slot mapping, block
tables for the decodes, and per-chunk info for prefills; then computes logits only where a
token is sampled (the last position of each request whose known tokens are all computed
after this step).

Attention goes through a backend (attention_backends/): the runner describes the step as one
ScheduledSeq per request and the backend builds its own metadata; cuda selects the Triton
kernels, anything else today's CPU path. On CUDA, pure decode steps replay captured graphs
(worker/cuda_graphs.py) unless --enforce-eager.

A request carrying k speculative tokens is laid out as k + 1 decode rows sharing its block
table, row j attending to positions up to start + j: all k + 1 positions are scored in the
same pass and the paged decode kernel serves them like any other decode. With a draft model
the runner also keeps the draft's KV (same block tables, its own tensor): the draft runs over
every step's tokens, then proposes the next drafts a token at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvserve.attention_backends import ScheduledSeq, make_backend
from kvserve.distributed.parallel_state import get_pp_group, get_tp_group
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.kv_quant import KV_SCALE_DTYPE, is_quantized, kv_storage_dtype
from kvserve.model.layers.sampler import row_argmax
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.platform.huge_pages import PendingFaults, huge_page_full, huge_page_zeros, weights_in_huge_pages
from kvserve.platform.memory import trim_heap
from kvserve.worker.device_sampling import sample_listed_rows
from kvserve.worker.kernel_log import log_kernels
from kvserve.worker.request_state import CachedRequestState, RequestStates
from kvserve.worker.shape_buckets import padded_rows
from kvserve.worker.step_input import RunnerOutput, StepInput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        use_cpu_kernels: bool = True,
        kv_cache_dtype: str = "auto",
        draft_model: LlamaForCausalLM | None = None,
        attention_backend: str | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.draft_model = draft_model
        self.device = device
        self.block_size = block_size
        self.dtype = model.dtype
        self.kv_cache_dtype = kv_cache_dtype
        # cuda -> the Triton kernels, otherwise today's CPU path (attention_backends/base.py)
        self.attn_backend = make_backend(device, block_size, attention_backend)
        self.graphs = None  # DecodeGraphRunner once captured (CUDA only: worker/cuda_graphs.py)
        self.seed = seed  # of the generator rows sampled on the device draw from
        self._generator: torch.Generator | None = None
        self.kv_cache, self.kv_scales = self._alloc_kv(model, num_blocks)
        self.draft_kv_cache = None
        if draft_model is not None:
            self.draft_kv_cache, _ = self._alloc_kv(draft_model, num_blocks)
        self.kv_pending_faults = PendingFaults(self.kv_cache, self.draft_kv_cache)
        self.requests = RequestStates()  # this worker's mirror of the scheduled requests
        self.tp, self.pp = get_tp_group(), get_pp_group()
        # The one rank that answers the engine: tensor-parallel rank 0 of the last stage.
        self.is_output_rank = self.tp.is_driver and self.pp.is_last
        if device.type == "cpu" and use_cpu_kernels:
            kernels = load_cpu_kernels()
            for m in (model, draft_model):
                if m is not None:
                    m.pack_weights()
                    weights_in_huge_pages(m)  # read front to back every token: fewer TLB misses
                    m.use_cpu_kernels(kernels)
            if self.tp.is_driver and self.pp.is_first:  # one line per engine, not per rank
                log_kernels(model, kernels is not None)
        elif device.type == "cuda" and self.attn_backend.name == "triton":
            from kvserve.model.layers.triton_layer_ops import TritonLayerOps

            for m in (model, draft_model):  # one kernel per small op (measured: docs/CUDA.md)
                if m is not None:
                    m.use_layer_ops(TritonLayerOps())
            if self.tp.is_driver and self.pp.is_first:
                logger.info("layer ops: Triton kernels (RMSNorm, rotary, SiLU-and-multiply)")
        if self._stack_takes_chunks():
            self.attn_backend.prompt_rows_as_decodes = True
        # Float projections with a 1-byte cache: a lone row runs as two, oneDNN's one-row kernel
        # sums in another order (shape_buckets.py) and the cache's codes turn those last bits
        # into steps. With a float cache the bits stay ~1e-6 apart (the near-tie rule), not worth
        # the second row: 1.06-1.10x the time of a float32 token at one stream. The decode
        # stack's own kernels give any row the same bits.
        kv = self.kv_cache.dtype
        self.min_rows = 2 if is_quantized(kv) and not self.model.stack_applies(kv) else 1
        trim_heap()  # the loader's temporaries and the plain weights packing replaced

    def _stack_takes_chunks(self) -> bool:
        """Whether every prompt chunk goes to the model as decode rows (each prompt token one
        row, attending through the paged decode kernel to its own causal length, the whole step
        in one C++ call): where the C++ decode stack runs the model (CPU, native quantized
        projections, a float32, int8 or fp8 cache). A draft model gets the same metadata: its
        layers (float, from Python) read prompt rows through the decode kernel too.

        Why every chunk: batch invariance. A token's attention is then the same arithmetic
        whether it came in a prompt chunk of any size, beside any requests, after a preemption
        or as a decode, and the projections give each row the same bits in any batch, so a
        greedy request gives the same bits alone or under load. Until round 38 chunks past 16K
        (query, key) pairs took SDPA, for the whole step: a short prompt beside a long one, or
        a preempted request's recomputed tokens, then summed in SDPA's order, last bits the int8
        activation codes round on: logprobs moved by up to ~0.1 and greedy text changed
        (tests/test_quant_chunks_as_decodes.py). Cost against SDPA on the AMX host
        (benchmarks/bench_chunks_as_decodes.py; docs/BENCHMARKS.md issue 16 round 38): 64-token
        chunks 0.77-1.12x, 512-token ones 1.04x at the prompt's start to 1.58x 1.5K tokens in,
        a 2K-token prompt's prefill ~1.4x.

        A float model with a 1-byte (int8 / fp8) cache and the C++ kernels lays its prompt rows
        out the same way, for the same reason: SDPA over a fresh chunk and over one after cached
        blocks differ in the last bits, and a K/V value that lands at a code's rounding edge
        then takes the next code, a step of up to 1/16 of the vector's range for fp8. On the
        default model (float32, fp8 cache) with this and a lone row's projections
        (shape_buckets.py) apart, logprobs moved by up to 0.27 between a prompt alone and
        beside others, and greedy text changed (tests/test_fidelity.py). With an int8 cache
        this costs about what the stack's layout does (default model, AMX host: a 1,500-token
        prefill 1.8-1.9 -> 2.0-2.1 s); with fp8 it was 3x, the decode kernel dequantizing every
        key through its table once per prompt row (2.0-2.4 -> 6.2 s); since round 44 a prompt's
        rows share each block's dequantized keys and values (csrc/paged_attention_cpu.cpp,
        BlockMemo): the kernel 0.25x its time on 512 rows 1,024 tokens in. A bf16 cache (a bf16
        model's own) too since round 44: SDPA's output, rounded to bf16, moved logprobs by up to
        0.10 between a prompt in one chunk and in 7-token ones. That costs 1.7-2.9x SDPA's time on
        512-token chunks (a 1,536-token prefill ~2.4x, 1.2x fp32's time on the AMX host: bf16
        keeps its memory, not its prefill speed; c=32 steps 0.94-1.01x;
        benchmarks/bench_chunks_as_decodes.py)."""
        if self.attn_backend.name != "cpu":
            return False
        if self.model.stack_applies(self.kv_cache.dtype):
            return True
        coarse = is_quantized(self.kv_cache.dtype) or self.kv_cache.dtype == torch.bfloat16
        return coarse and any(la.attn.kernels is not None for la in self.model.layers)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward at each graph size (CUDA + Triton backend only)."""
        if self.device.type != "cuda" or self.attn_backend.name != "triton":
            return
        from kvserve.worker.cuda_graphs import DecodeGraphRunner

        width = -(-max_model_len // self.block_size)
        graphs = DecodeGraphRunner(self.model, self.kv_cache, self.attn_backend, max_num_seqs, width)
        try:
            graphs.capture()
        except RuntimeError as e:  # a forward that cannot be captured still serves, eagerly
            logger.warning("decode CUDA graphs not captured, running eagerly: %s", e)
            return
        self.graphs = graphs

    def _device_generator(self) -> torch.Generator:
        """The generator of the unseeded rows sampled on the device, made on first use."""
        if self._generator is None:
            self._generator = torch.Generator(self.device).manual_seed(self.seed)
        return self._generator

    def _forward(self, ids: list[int], positions: np.ndarray, meta, graphable: bool) -> torch.Tensor:
        """The model over this step's rows: a captured CUDA graph for a pure decode step that
        fits one, else eagerly over the rows padded to a bucket size (shape_buckets.py)."""
        if graphable and self.graphs is not None and self.graphs.fits(meta):
            ids_t = torch.tensor(ids, device=self.device)
            return self.graphs.run(ids_t, torch.from_numpy(positions).to(self.device), meta)
        ids_t, pos_t = self._padded_inputs(ids, positions)
        hidden_in = None
        if not self.pp.is_first:  # the previous stage's residual stream for these rows
            hidden_in = self.pp.recv_prev((len(ids_t), self.model.arch.hidden_size), self.dtype, self.device)
        return self.model(ids_t, pos_t, meta, self.kv_cache, hidden_in)

    def _padded_inputs(self, ids: list[int], positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        pad = padded_rows(len(ids), self.min_rows) - len(ids)  # rows past the slot mapping: never stored
        ids_t = torch.tensor(ids + [0] * pad if pad else ids, device=self.device)
        # (np.pad costs ~30 us even with nothing to add: a decode step's per-token overhead)
        return ids_t, torch.from_numpy(np.pad(positions, (0, pad)) if pad else positions).to(self.device)

    def _alloc_kv(self, model: LlamaForCausalLM, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's KV pool and, for a 1-byte cache, its bfloat16 scales (one per token and
        kv head), which the model's attention layers are given. On the CPU both are in huge
        pages where the OS grants them (platform/huge_pages.py: decode reads scattered blocks)."""
        arch = model.arch
        kv_dtype = kv_storage_dtype(self.kv_cache_dtype, model.dtype)

        on_cpu = torch.device(self.device).type == "cpu"

        def full(shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
            if on_cpu:
                return huge_page_full(shape, value, dtype)
            return torch.full(shape, value, dtype=dtype, device=self.device)

        layers, kv_heads = len(model.layers), model.num_local_kv_heads
        kv_shape = (layers, 2, num_blocks, kv_heads, self.block_size, arch.head_dim)
        if on_cpu:  # zero pages, faulted in once the engine is ready and idle (PendingFaults)
            cache = huge_page_zeros(kv_shape, kv_dtype)
        else:
            cache = full(kv_shape, 0, kv_dtype)
        scales = None
        if is_quantized(kv_dtype):
            scales = full(kv_shape[:-1], 1, KV_SCALE_DTYPE)
            for i, layer in enumerate(model.layers):
                layer.attn.kv_scales = (scales[i, 0], scales[i, 1])
        return cache, scales

    @staticmethod
    def _is_decode(req: CachedRequestState, n: int) -> bool:
        """One new token, or the last known token plus speculative ones."""
        return n == 1 or req.num_computed_tokens + n > req.num_tokens

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RunnerOutput | None:
        """Run one step. Returns, on rank 0, the logits of the rows that produce a token (the
        last row of each request whose known tokens are all computed, and the k + 1 rows of
        each speculative one) and the prompt logprobs computed; None on other ranks."""
        if step.block_copies:
            self._copy_blocks(step.block_copies)
        batch = self.requests.apply(step)
        if not batch:
            return RunnerOutput() if self.is_output_rank else None
        order = sorted(batch, key=lambda x: not self._is_decode(*x))
        ids: list[int] = []
        pos: list[int] = []  # flat positions (a list, not an array per request: ~1 us each at 64 rows)
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        verify: list[tuple[str, int, int]] = []  # (req_id, first flat row, number of drafts)
        prompt_lp: list[tuple[CachedRequestState, int, int]] = []  # (req, first flat row, count)
        pooling: list[tuple[CachedRequestState, int, int]] = []  # embedding requests' rows
        seqs: list[ScheduledSeq] = []  # the step as the attention backend sees it
        offset = 0
        for req, n in order:
            start = req.num_computed_tokens
            known = req.all_token_ids[start : start + n]
            drafts = req.spec_token_ids[: n - len(known)]
            ids.extend(known)
            ids.extend(drafts)
            pos.extend(range(start, start + n))
            seqs.append(ScheduledSeq(start, n, req.block_ids, self._is_decode(req, n)))
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(n, req.num_prompt_tokens - 1 - start)
                prompt_lp.append((req, offset, count))
            if req.pooling is not None:
                pooling.append((req, offset, n))
            elif drafts:
                verify.append((req.req_id, offset, len(drafts)))
            elif start + n == req.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_ids.append(req.req_id)
            offset += n

        positions = np.array(pos, dtype=np.int64)
        meta = self.attn_backend.build_metadata(seqs, positions)

        out = RunnerOutput(sample_ids, [(rid, k) for rid, _, k in verify])
        if len(sample_rows) == len(ids) and self._fuses_logits():  # one row a request, each sampled
            logits = self.model.decode_logits(*self._padded_inputs(ids, positions), meta, self.kv_cache)
            self._put_logits(out, None if logits is None else logits[: len(ids)], step)
            return out if self.is_output_rank else None

        graphable = not (prompt_lp or pooling) and self.draft_model is None
        hidden = self._forward(ids, positions, meta, graphable)
        if not self.pp.is_last:
            self.pp.send_next(hidden)  # and on to the next micro-batch without waiting
            return None
        if self.draft_model is not None:  # the draft's KV follows every computed position
            self.draft_model(*self._padded_inputs(ids, positions), meta, self.draft_kv_cache)

        rows = sample_rows + [o + j for _, o, k in verify for j in range(k + 1)]
        if rows:
            self._put_logits(out, self._logits(self.model, hidden, rows), step)
        for r, o, c in pooling:
            vector = self._pool(r, hidden, o, c)
            if vector is not None:
                out.pooled[r.req_id] = vector
        for r, o, c in prompt_lp:
            found = self._prompt_logprobs(r, hidden, o, c)
            if found is not None:
                out.prompt_logprobs[r.req_id], out.prompt_logprob_ranks[r.req_id] = found
        return out if self.is_output_rank else None

    def _fuses_logits(self) -> bool:
        """Whether a step whose every row is sampled goes through model.decode_logits (the
        hidden states never leave the model: on the CPU, the decode stack's one call): one
        pipeline stage, no draft model, no CUDA graphs to replay instead."""
        return self.pp.is_first and self.pp.is_last and self.draft_model is None and self.graphs is None

    def _put_logits(self, out: RunnerOutput, logits: torch.Tensor | None, step: StepInput) -> None:
        """The sampled rows' logits into `out`: sampled here (device sampling) or handed on."""
        if logits is not None and step.device_sampling is not None:  # worker/device_sampling.py
            sample_listed_rows(out, logits, step.device_sampling, self._device_generator())
        elif logits is not None:
            out.logits = logits.float().cpu()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each destination block gets its source's KV (all layers, this rank's
        heads; the scales of a 1-byte cache and the draft model's KV too)."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for t in (self.kv_cache, self.kv_scales, self.draft_kv_cache):
            if t is not None:
                t[:, :, dst] = t[:, :, src]

    @staticmethod
    def _pool(req: CachedRequestState, hidden: torch.Tensor, offset: int, count: int) -> torch.Tensor | None:
        """An embedding request's chunk: accumulate (mean) and, once the prompt is done, its
        vector (float32, CPU). A prompt recomputed from 0 (preemption) starts the sum again."""
        start = req.num_computed_tokens
        rows = hidden[offset : offset + count].float()
        if req.pooling == "mean":
            part = rows.sum(0)
            req.pool_sum = part if start == 0 or req.pool_sum is None else req.pool_sum + part
        if start + count < req.num_prompt_tokens:
            return None
        vector = req.pool_sum / req.num_prompt_tokens if req.pooling == "mean" else rows[-1]
        return vector.cpu()

    def _logits(self, model: LlamaForCausalLM, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Logits of these rows of `hidden`, computed over a bucket-sized batch (shape_buckets.py)."""
        index = rows + rows[:1] * (padded_rows(len(rows), self.min_rows) - len(rows))
        logits = model.compute_logits(hidden[torch.tensor(index, device=self.device)])
        return None if logits is None else logits[: len(rows)]

    @torch.inference_mode()
    def propose_with_draft(
        self,
        items: list[tuple[str, int, int, int]],
        block_tables: dict[str, list[int]],
        mask: Callable[[list[str], dict[str, list[int]], torch.Tensor], None] | None = None,
    ) -> dict[str, list[int]]:
        """Greedy drafts of up to k tokens per (req_id, last token, num_tokens, k), one batched
        draft decode per token; `mask(req_ids, drafts, logits)`, if given, constrains each
        round's logits first (spec_decode/grammar_mask.py).

        Each request's last token is not in the draft's KV yet: round j feeds the token at
        position num_tokens - 1 + j (the last token, then the drafts so far) and writes its KV
        into slots the scheduler reserved ahead."""
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in items}
        for j in range(max((k for *_, k in items), default=0)):
            active = [(rid, last, n) for rid, last, n, k in items if k > j]
            ids = [drafts[rid][-1] if j else last for rid, last, _ in active]
            positions = np.array([n - 1 + j for _, _, n in active])
            seqs = [
                ScheduledSeq(int(p), 1, block_tables[rid], True) for (rid, _, _), p in zip(active, positions)
            ]
            meta = self.attn_backend.build_metadata(seqs, positions)
            pad = padded_rows(len(ids), self.min_rows) - len(ids)
            hidden = self.draft_model(
                torch.tensor(ids + [0] * pad, device=self.device),
                torch.from_numpy(np.pad(positions, (0, pad))).to(self.device), meta, self.draft_kv_cache,
            )  # fmt: skip
            logits = self._logits(self.draft_model, hidden, list(range(len(ids))))
            if mask is not None:
                mask([rid for rid, _, _ in active], drafts, logits)
            next_ids = row_argmax(logits).tolist()
            for (rid, _, _), t in zip(active, next_ids):
                drafts[rid].append(t)
        return drafts

    def _prompt_logprobs(
        self, req: CachedRequestState, hidden: torch.Tensor, offset: int, count: int
    ) -> tuple[list[dict[int, float] | None], list[int]] | None:
        """Logprob of each next prompt token (plus top-k) for `count` positions of this chunk,
        and each token's rank in the vocabulary (vLLM's: 1 + the tokens above it, which the
        top-k cannot tell for a token outside it); None on tensor-parallel ranks other than 0,
        which only take part in the gather."""
        logits = self._logits(self.model, hidden, list(range(offset, offset + count)))
        if logits is None:
            return None
        logprobs = logits.cpu().log_softmax(-1)
        start = req.num_computed_tokens
        targets = torch.tensor(req.all_token_ids[start + 1 : start + 1 + count])
        chosen_t = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        k = req.prompt_logprobs or 0
        top = logprobs.topk(k, dim=-1) if k else None
        entries = []
        for j in range(count):
            entry = {int(targets[j]): chosen[j]}
            if top is not None:
                for t, v in zip(top.indices[j].tolist(), top.values[j].tolist()):
                    entry.setdefault(t, v)
            entries.append(entry)
        return entries, ranks
