"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step at batch 8 on a GPU is dozens of small kernel launches per layer; the CPU time to
launch them is longer than the GPU time to run them. A CUDA graph records the launches once and
replays them in one call, so decode runs at the GPU's pace. A graph replays fixed shapes and
fixed addresses, hence:
- captured batch sizes 1, 2, 4, 8, 16, 32, ... up to max_num_seqs (`capture_sizes`); a batch
  is padded up to the next captured size (`graph_size_for`), larger ones run eagerly;
- persistent input buffers (token ids, positions, slot mapping, block tables, sequence
  lengths) that every replay copies the step into; padding rows get slot -1 (nothing stored)
  and length 0 (attention outputs zeros), so they never touch a real request's KV;
- a block-table width fixed at max_model_len / block_size and a fixed split count for the
  decode kernel (the Triton backend's metadata carries it);
- one memory pool shared by all sizes, captured largest first; its size is estimated before
  the KV pool is sized (`graph_pool_bytes_estimate`, subtracted from the KV budget) and
  measured after capture (logged).

Only pure decode steps of a single-rank engine go through graphs (no prefill chunk, no prompt
logprobs, no pooling, no pipeline stages); everything else, and `--enforce-eager`, runs
eagerly. This module imports without a GPU; capturing needs CUDA and the Triton backend.
"""

from __future__ import annotations

import bisect
import logging

import torch

logger = logging.getLogger(__name__)

GRAPH_POOL_FLOOR = 64 << 20  # graph objects, cuBLAS workspaces, allocator rounding


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


def graph_size_for(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `num_rows`; None when it needs an eager run."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def graph_pool_bytes_estimate(
    max_batch: int,
    hidden: int,
    intermediate: int,
    q_size: int,
    kv_size: int,
    num_heads: int,
    dtype_bytes: int,
) -> int:
    """What the shared graph pool may hold: the largest batch's live activations (residual,
    norms, fused qkv, gate_up, attention output and the split-K partials in float32), doubled
    for the allocator's slack, plus a floor. Deliberately generous: an underestimate would run
    the KV pool out of memory at capture, an overestimate costs a few blocks."""
    from kvserve.attention_backends.triton_kernels.constants import DECODE_MAX_SPLITS

    per_row = (4 * hidden + 2 * intermediate + q_size + 2 * kv_size) * dtype_bytes
    per_row += num_heads * DECODE_MAX_SPLITS * (q_size // num_heads + 2) * 4
    return 2 * max_batch * per_row + GRAPH_POOL_FLOOR


class DecodeGraphRunner:
    """Captured decode forwards of one model, one per size, over persistent buffers."""

    def __init__(
        self, model, kv_cache: torch.Tensor, backend, max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        from kvserve.attention_backends.triton_kernels.constants import num_decode_splits

        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = capture_sizes(max_num_seqs)
        dev, n = kv_cache.device, self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.num_splits = num_decode_splits(max_blocks_per_seq, backend.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0

    def _meta(self, size: int):
        from kvserve.attention_backends.triton_backend import TritonAttentionMetadata

        return TritonAttentionMetadata(
            self.backend, size, self.slot_mapping[:size], num_decodes=size,
            decode_block_tables=self.block_tables[:size], decode_seq_lens=self.seq_lens[:size],
            decode_num_splits=self.num_splits,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one pool; record the memory it took."""
        if self.kv_cache.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device (use --enforce-eager elsewhere)")
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_cache)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_cache)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.pool_bytes = free_before - torch.cuda.mem_get_info()[0]
        mib = self.pool_bytes / 2**20
        logger.info("captured decode CUDA graphs for %s sequences: %.0f MiB", self.sizes, mib)

    def size_for(self, num_rows: int) -> int | None:
        return graph_size_for(num_rows, self.sizes) if self.graphs else None

    def fits(self, meta) -> bool:
        """A pure decode step (Triton metadata) that a captured graph can replay: every row a
        decode, a captured size that holds them, block tables no wider than the buffer."""
        n = meta.num_decodes
        return (
            n == meta.num_tokens
            and self.size_for(n) is not None
            and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Replay the graph for this decode step (Triton metadata, decode rows only): copy it
        into the buffers, pad, replay; the hidden states of its rows (a view of the graph's output)."""
        graph, out = self.graphs[self.load(input_ids, positions, meta)]
        graph.replay()
        return out[: meta.num_decodes]

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> int:
        """Copy a decode step into the persistent buffers, padding rows up to the captured size
        (slot -1: nothing stored; length 0: zeros out); returns that size."""
        n = meta.num_decodes
        size = graph_size_for(n, self.sizes)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n])
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:size].fill_(0)
        return size
