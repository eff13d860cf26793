"""Paged attention: metadata for one step and the attention backend.

The KV cache of one layer is a pair of tensors shaped [num_blocks, kv_heads, block_size,
head_dim], so one kv head's slice of a block is contiguous. New keys/values are written
through the step's slot mapping (block id + offset per token); attention reads them back
through block tables. The model runner builds one AttentionMetadata per step and every
layer reuses it, so index tensors and masks are computed once per step, not per layer.

The batch is laid out decodes first (one query token each), then prefill chunks, then any
padding rows (worker/shape_buckets.py), which are neither stored nor attended to. Decodes
go through the C++ paged kernel on CPU when it is available (it reads K/V in place), or a
gather + SDPA path otherwise; prefill chunks use SDPA one request at a time, with a causal
mask offset by the tokens already cached (unless the CPU backend lays small chunks out as
decode rows: attention_backends/cpu.py). A CUDA backend (FlashAttention / Triton) would take
the same metadata.

Since the attention-backend seam (kvserve/attention_backends/), the metadata a backend builds
carries the backend (`meta.backend`) and `forward` hands the call to it: the CPU backend comes
back to `forward_torch` below, the Triton backend runs its own kernels. Metadata built by hand
(tests) has no backend and takes `forward_torch`.

With a 1-byte KV cache (kv_quant.py) the model runner binds each layer's scale tensors to
its attention (`kv_scales`, as vLLM's Attention layer holds its k/v scales): new K/V are
quantized as they are written, every read dequantizes, and a fresh prompt chunk attends to
its own K/V after the same round trip, so prefill sees exactly what later decodes read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model.layers.kv_quant import dequantize_kv, quantize_kv


@dataclass
class PrefillChunk:
    """One request's prompt chunk in this step."""

    start: int  # offset of its first query token in the flat batch
    end: int
    num_cached: int  # tokens already in the KV cache before this chunk
    block_ids: torch.Tensor | None = None  # set when num_cached > 0
    mask: torch.Tensor | None = None  # [q, num_cached + q] bool, set when num_cached > 0


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward pass, shared by all layers."""

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token's slot
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend: Any = None  # the attention backend that built it (attention_backends/cpu.py)
    _gather: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode_gather_inputs(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat block ids and a [n, 1, 1, L] validity mask for the gather path (cached)."""
        if self._gather is None:
            tables, lens = self.decode_block_tables, self.decode_seq_lens
            width = tables.shape[1] * block_size
            mask = torch.arange(width, device=lens.device).unsqueeze(0) < lens.unsqueeze(1)
            self._gather = (tables.reshape(-1), mask.view(len(lens), 1, 1, width))
        return self._gather


NO_SCALES = torch.empty(0)  # what the C++ kernel is given for an unquantized cache


def _gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None = None, dtype=None
) -> torch.Tensor:
    """[n_blocks, kv_heads, block_size, hd] blocks -> [kv_heads, n_blocks * block_size, hd],
    dequantized to `dtype` when the cache holds codes with `scales` [blocks, kv_heads, block_size]."""
    blocks = cache.index_select(0, block_ids)
    if scales is not None:
        blocks = dequantize_kv(blocks, scales.index_select(0, block_ids), dtype)
    n, kvh, bs, hd = blocks.shape
    return blocks.transpose(0, 1).reshape(kvh, n * bs, hd)


class PagedAttention:
    """Paged attention over torch tensors; the decode kernel is C++ on CPU when built."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kernels = None  # set by the model runner when the C++ kernels are loaded
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # 1-byte caches only

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        backend = getattr(meta, "backend", None)
        if backend is not None:
            return backend.forward(self, q, k, v, k_cache, v_cache, meta)
        return self.forward_torch(q, k, v, k_cache, v_cache, meta)

    def forward_torch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The torch path: C++ paged decode on CPU when loaded (SDPA gather otherwise), SDPA prefill."""
        n = meta.slot_blocks.shape[0]  # rows past n only pad the batch to a bucket size
        if self.kv_scales is None and self.kernels is not None and k.dtype == k_cache.dtype:
            self.kernels.kv_write(k_cache, v_cache, k, v, meta.slot_blocks, meta.slot_offsets)
        elif self.kv_scales is None:
            k_cache[meta.slot_blocks, :, meta.slot_offsets] = k[:n]
            v_cache[meta.slot_blocks, :, meta.slot_offsets] = v[:n]
        else:
            k, v = self._write_quantized(k[:n], v[:n], k_cache, v_cache, meta)
        nd = meta.num_decodes
        if nd == q.shape[0]:  # every row a decode, none padding: the kernel's output is the answer
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if n < q.shape[0]:
            out[n:] = 0
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk)
        return out

    def _write_quantized(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store codes and scales; return K/V as the cache will give them back."""
        blocks, offsets = meta.slot_blocks, meta.slot_offsets
        if self.kernels is not None and k.device.type == "cpu":  # int8 or fp8 codes, quantize_kv's bits
            ks, vs = self.kv_scales
            self.kernels.kv_write_codes(k_cache, v_cache, ks, vs, k, v, blocks, offsets, bool(meta.prefills))
            return k, v  # rounded in place where a prefill attends to them
        out = []
        for x, cache, scales in ((k, k_cache, self.kv_scales[0]), (v, v_cache, self.kv_scales[1])):
            codes, s = quantize_kv(x, cache.dtype)
            cache[blocks, :, offsets] = codes
            scales[blocks, :, offsets] = s
            out.append(dequantize_kv(codes, s, x.dtype) if meta.prefills else x)
        return out[0], out[1]

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        ks, vs = self.kv_scales or (None, None)
        if self.kernels is not None and q.device.type == "cpu":
            ks, vs = (NO_SCALES, NO_SCALES) if ks is None else (ks, vs)
            return self.kernels.paged_decode_attention(
                q.contiguous(), k_cache, v_cache, ks, vs,
                meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            )  # fmt: skip
        n, dt = q.shape[0], q.dtype
        block_ids, mask = meta.decode_gather_inputs(k_cache.shape[2])
        keys = _gather_kv(k_cache, block_ids, ks, dt).view(self.num_kv_heads, n, -1, self.head_dim)
        values = _gather_kv(v_cache, block_ids, vs, dt).view(self.num_kv_heads, n, -1, self.head_dim)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        if chunk.num_cached == 0:
            # Fresh prompt: its keys are exactly this chunk's, no need to read the cache.
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            total = chunk.num_cached + q.shape[0]
            ks, vs = self.kv_scales or (None, None)
            keys = _gather_kv(k_cache, chunk.block_ids, ks, q.dtype)[:, :total]
            values = _gather_kv(v_cache, chunk.block_ids, vs, q.dtype)[:, :total]
            mask, causal = chunk.mask, False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)
