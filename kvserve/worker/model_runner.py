"""Turns a scheduler decision into tensors, runs the model once, and samples.

Owns the KV pool tensor. Per step it builds flat input ids and positions (all requests'
new tokens concatenated, decodes first), the slot mapping, block tables for the decodes,
and per-chunk info for prefills; then computes logits only where a token is sampled (the
last position of each request whose known tokens are all computed after this step).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.core.scheduler import SchedulerOutput
from kvserve.model.layers.attention import AttentionMetadata, PrefillChunk
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.sampler import Sampler
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.request import Request
from kvserve.structured.bitmask import apply_grammar_bitmask


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        use_cpu_kernels: bool = True,
    ) -> None:
        arch = model.arch
        self.model = model
        self.device = device
        self.block_size = block_size
        self.dtype = model.embed_tokens.dtype
        self.kv_cache = torch.zeros(
            arch.num_layers, 2, num_blocks, arch.num_kv_heads, block_size, arch.head_dim,
            dtype=self.dtype, device=device,
        )  # fmt: skip
        self.sampler = Sampler(seed)
        if device.type == "cpu" and use_cpu_kernels:
            model.pack_weights()
            kernels = load_cpu_kernels()
            for layer in model.layers:
                layer.attn.kernels = kernels

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> tuple[dict[str, int], dict[str, list[dict[int, float] | None]]]:
        """Run one step. Returns sampled token per request id, and prompt logprobs computed."""
        # Decodes (one new token) first, then prefill chunks.
        order = sorted(out.scheduled, key=lambda x: x[1] != 1)
        bs = self.block_size
        ids: list[int] = []
        pos_chunks, slot_chunks = [], []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_lp: list[tuple[Request, int, int]] = []  # (req, first flat row, count)
        meta = AttentionMetadata(torch.empty(0), torch.empty(0))
        decode_tables, decode_lens = [], []
        offset = 0
        for req, n in order:
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start : start + n])
            pos = np.arange(start, start + n)
            table = block_tables[req.request_id]
            pos_chunks.append(pos)
            slot_chunks.append(np.asarray(table)[pos // bs])
            if n == 1:
                meta.num_decodes += 1
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                chunk = PrefillChunk(offset, offset + n, start)
                if start > 0:
                    nb = -(-(start + n) // bs)
                    chunk.block_ids = torch.tensor(table[:nb], device=self.device)
                    q_pos = torch.arange(start, start + n).unsqueeze(1)
                    chunk.mask = (torch.arange(start + n).unsqueeze(0) <= q_pos).to(self.device)
                meta.prefills.append(chunk)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(n, req.num_prompt_tokens - 1 - start)
                prompt_lp.append((req, offset, count))
            if start + n == req.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(req)
            offset += n

        positions = np.concatenate(pos_chunks)
        meta.slot_blocks = torch.from_numpy(np.concatenate(slot_chunks)).to(self.device)
        meta.slot_offsets = torch.from_numpy(positions % bs).to(self.device)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            table_arr = np.zeros((len(decode_tables), width), dtype=np.int64)
            for i, t in enumerate(decode_tables):
                table_arr[i, : len(t)] = t
            meta.decode_block_tables = torch.from_numpy(table_arr).to(self.device)
            meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)

        hidden = self.model(
            torch.tensor(ids, device=self.device),
            torch.from_numpy(positions).to(self.device),
            meta,
            self.kv_cache,
        )
        sampled: dict[str, int] = {}
        if sample_reqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)]).cpu()
            apply_grammar_bitmask(logits, sample_reqs)  # [structured outputs] constrained rows only
            result = self.sampler(logits, sample_reqs)
            for req, tok, lp in zip(sample_reqs, result.token_ids, result.logprobs):
                sampled[req.request_id] = tok
                if lp is not None:
                    req.logprobs.append(lp)
        prompt_logprobs = {r.request_id: self._prompt_logprobs(r, hidden, o, c) for r, o, c in prompt_lp}
        return sampled, prompt_logprobs

    def _prompt_logprobs(
        self, req: Request, hidden: torch.Tensor, offset: int, count: int
    ) -> list[dict[int, float] | None]:
        """Logprob of each next prompt token (plus top-k) for `count` positions of this chunk."""
        logprobs = self.model.compute_logits(hidden[offset : offset + count]).cpu().log_softmax(-1)
        start = req.num_computed_tokens
        targets = torch.tensor(req.all_token_ids[start + 1 : start + 1 + count])
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = req.params.prompt_logprobs or 0
        top = logprobs.topk(k, dim=-1) if k else None
        entries = []
        for j in range(count):
            entry = {int(targets[j]): chosen[j]}
            if top is not None:
                for t, v in zip(top.indices[j].tolist(), top.values[j].tolist()):
                    entry.setdefault(t, v)
            entries.append(entry)
        return entries
