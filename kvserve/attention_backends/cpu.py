"""The CPU backend: today's path behind the backend seam, with identical results.

The metadata is attention.py's AttentionMetadata built exactly as the model runner built it
before the seam existed (slot blocks/offsets, decode block tables and lengths, one
PrefillChunk per prompt chunk with its causal mask offset by the cached tokens); the forward
is PagedAttention.forward_torch (the C++ paged decode kernel when loaded, SDPA otherwise).

One layout is new: where the model runner sets `prompt_rows_as_decodes` (its model runs the
C++ decode stack), every prompt token is laid out as a decode row instead, with the request's
block table and its own causal length (as speculative rows are), so the stack runs the whole
step in one call and each row's attention is the decode kernel's, whatever chunk it came in.
The results differ from the SDPA chunks by summation order only (tests/test_quant_chunks_as_decodes.py).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention_backends.base import ScheduledSeq
from kvserve.model.layers.attention import AttentionMetadata, PagedAttention, PrefillChunk


def padded_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one [n, longest] int64 tensor, short rows padded with block 0."""
    width = max(len(t) for t in tables)
    arr = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        arr[i, : len(t)] = t
    return torch.from_numpy(arr).to(device)


def slot_blocks_of(seqs: list[ScheduledSeq], positions: np.ndarray, block_size: int) -> np.ndarray:
    """The physical block of each new token's slot, in batch order."""
    out, i = [], 0
    for s in seqs:
        out.append(np.asarray(s.block_table)[positions[i : i + s.num_tokens] // block_size])
        i += s.num_tokens
    return np.concatenate(out)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        # Prompt chunks as decode rows (one query each, its own length, the request's block
        # table). The model runner sets it where the C++ decode stack runs those steps whole
        # (LlamaForCausalLM.stack_applies): see ModelRunner._stack_takes_chunks.
        self.prompt_rows_as_decodes = False

    def build_metadata(self, seqs: list[ScheduledSeq], positions: np.ndarray) -> AttentionMetadata:
        if seqs and all(s.is_decode and s.num_tokens == 1 for s in seqs):
            return self._decode_metadata(seqs)
        return self._metadata(seqs, positions)

    def _metadata(self, seqs: list[ScheduledSeq], positions: np.ndarray) -> AttentionMetadata:
        bs, dev = self.block_size, self.device
        meta = AttentionMetadata(
            torch.from_numpy(slot_blocks_of(seqs, positions, bs)).to(dev),
            torch.from_numpy(positions % bs).to(dev),
            backend=self,
        )
        decode_tables, decode_rows, decode_lens = [], [], []
        offset = 0
        for s in seqs:
            start, n = s.start, s.num_tokens
            if s.is_decode or self.prompt_rows_as_decodes:
                meta.num_decodes += n
                decode_tables.append(s.block_table)
                decode_rows.append(n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                chunk = PrefillChunk(offset, offset + n, start)
                if start > 0:
                    nb = -(-(start + n) // bs)
                    chunk.block_ids = torch.tensor(s.block_table[:nb], device=dev)
                    q_pos = torch.arange(start, start + n).unsqueeze(1)
                    chunk.mask = (torch.arange(start + n).unsqueeze(0) <= q_pos).to(dev)
                meta.prefills.append(chunk)
            offset += n
        if decode_tables:  # a chunk's rows share its table: padded once, then repeated
            tables = padded_table_tensor(decode_tables, dev)
            meta.decode_block_tables = tables.repeat_interleave(torch.tensor(decode_rows, device=dev), dim=0)
            meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        return meta

    def _decode_metadata(self, seqs: list[ScheduledSeq]) -> AttentionMetadata:
        """A step of one new token per sequence, all decodes: what the general path builds, from
        the Python lists directly (each numpy or torch op is a few microseconds a step, more
        when the step's weight stream has just pushed the interpreter out of the caches)."""
        bs, dev = self.block_size, self.device
        width = max(len(s.block_table) for s in seqs)
        # [3, n]: each row contiguous, as the kernels read them
        rows = [(s.block_table[s.start // bs], s.start % bs, s.start + 1) for s in seqs]
        slots = torch.tensor(list(zip(*rows)))
        meta = AttentionMetadata(slots[0].to(dev), slots[1].to(dev), num_decodes=len(seqs), backend=self)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64).to(dev)
        meta.decode_seq_lens = slots[2].to(dev)
        return meta

    def forward(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return layer.forward_torch(q, k, v, k_cache, v_cache, meta)
