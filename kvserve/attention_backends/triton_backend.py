"""The CUDA backend: Triton kernels for the KV write, paged decode and varlen chunked prefill.

Metadata is built once per step as flat index tensors (what the kernels read, like vLLM's
FlashAttention metadata): a slot per new token (block * block_size + offset), the decode rows'
block tables and lengths, and for the prefill chunks cu_seqlens-style `query_start`, the
tokens each chunk finds cached (`context_lens`: an earlier chunk or a prefix-cache hit) and
their block tables. The forward is three launches whatever the batch: write K/V, decode all
decode rows (split-K + reduce), prefill all chunks in one launch.

This module imports without triton and without a GPU (the kernels are imported when the
backend is built); `require_triton` says what is missing. Under TRITON_INTERPRET=1 the backend
runs on CPU tensors, which is how tests/test_triton_kernels.py compares it with the CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention_backends.base import ScheduledSeq
from kvserve.attention_backends.triton_kernels import require_triton
from kvserve.core.block_size import gpu_block_size_problem


@dataclass
class TritonAttentionMetadata:
    backend: TritonAttentionBackend
    num_tokens: int  # rows of the step; rows past it (padding) come out as zeros
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset, -1: not stored
    num_decodes: int = 0  # the first rows: one query token each
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, width] int32
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32, including the new token
    decode_num_splits: int | None = None  # fixed for a captured graph; None: from the table width
    prefill_block_tables: torch.Tensor | None = None  # [chunks, width] int32
    prefill_query_start: torch.Tensor | None = None  # [chunks + 1] int32: flat rows, cu_seqlens
    prefill_context_lens: torch.Tensor | None = None  # [chunks] int32: tokens cached before the chunk
    max_query_len: int = 0


def _tables(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    out = np.zeros((len(tables), width or max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device, block_size: int) -> None:
        require_triton()
        if problem := gpu_block_size_problem(block_size):
            raise ValueError(f"the Triton attention backend: {problem}")
        from kvserve.attention_backends.triton_kernels import kv_write, paged_decode, paged_prefill

        self._write, self._decode, self._prefill = (
            kv_write.write_kv,
            paged_decode.paged_decode,
            paged_prefill.paged_prefill,
        )
        self.device = device
        self.block_size = block_size

    def build_metadata(self, seqs: list[ScheduledSeq], positions: np.ndarray) -> TritonAttentionMetadata:
        bs, dev = self.block_size, self.device
        slots, i = np.empty(len(positions), dtype=np.int64), 0
        for s in seqs:
            pos = positions[i : i + s.num_tokens]
            slots[i : i + s.num_tokens] = np.asarray(s.block_table)[pos // bs] * bs + pos % bs
            i += s.num_tokens
        meta = TritonAttentionMetadata(self, len(positions), torch.from_numpy(slots).to(dev))
        dec_tables, dec_lens, pre_tables, starts, contexts = [], [], [], [0], []
        row = 0
        for s in seqs:
            if s.is_decode:
                dec_tables.extend([s.block_table] * s.num_tokens)
                dec_lens.extend(range(s.start + 1, s.start + s.num_tokens + 1))
            else:
                if not pre_tables:
                    starts = [row]
                pre_tables.append(s.block_table)
                starts.append(row + s.num_tokens)
                contexts.append(s.start)
                meta.max_query_len = max(meta.max_query_len, s.num_tokens)
            row += s.num_tokens
        if dec_tables:
            meta.num_decodes = len(dec_lens)
            meta.decode_block_tables = torch.from_numpy(_tables(dec_tables)).to(dev)
            meta.decode_seq_lens = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
        if pre_tables:
            meta.prefill_block_tables = torch.from_numpy(_tables(pre_tables)).to(dev)
            meta.prefill_query_start = torch.tensor(starts, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
        return meta

    def forward(
        self,
        layer,
        q: torch.Tensor,  # [rows, heads, head_dim]
        k: torch.Tensor,  # [rows, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
    ) -> torch.Tensor:
        ks, vs = layer.kv_scales or (None, None)
        n = meta.num_tokens
        self._write(k[:n], v[:n], k_cache, v_cache, meta.slot_mapping, ks, vs)
        out = torch.zeros_like(q)
        nd = meta.num_decodes
        if nd:
            self._decode(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, layer.scale,
                out[:nd], ks, vs, meta.decode_num_splits,
            )  # fmt: skip
        if meta.prefill_context_lens is not None:
            self._prefill(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_lens, meta.max_query_len, layer.scale, out, ks, vs,
            )  # fmt: skip
        return out
