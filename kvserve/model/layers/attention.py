"""Paged attention: metadata for one step and a pure-PyTorch backend.

The KV cache of one layer is a pair of tensors shaped [num_blocks, block_size, kv_heads,
head_dim]. New keys/values are written through the step's slot mapping (flat slot =
block_id * block_size + offset); attention reads them back through block tables. The model
runner builds one AttentionMetadata per step and every layer reuses it, so index tensors
and masks are computed once per step, not once per layer.

The batch is laid out decodes first (one query token each, attended together in one
batched call), then prefill chunks (attended one request at a time with a causal mask
offset by the tokens already cached). A CUDA backend (FlashAttention / Triton) would take
the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decodes: int = 0
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * max_blocks] flattened
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchPagedAttention:
    """Paged attention with torch ops only; runs on CPU and CUDA alike."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        kvh, hd = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = q.shape[0]
        keys = k_cache.index_select(0, meta.decode_block_ids).view(n, -1, self.num_kv_heads, self.head_dim)
        values = v_cache.index_select(0, meta.decode_block_ids).view(n, -1, self.num_kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [n, heads, 1, hd]
            keys.transpose(1, 2),  # [n, kv_heads, L, hd]
            values.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
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
            keys, values, mask, causal = k, v, None, True
        else:
            total = chunk.num_cached + q.shape[0]
            keys = k_cache.index_select(0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
            values = v_cache.index_select(0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
            mask, causal = chunk.mask, False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)
