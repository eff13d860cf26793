"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Takes flat token tensors (all requests of a step concatenated) and knows nothing about
scheduling. q/k/v and gate/up projections are fused into single matmuls at load time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.arch import ModelArch
from kvserve.model.layers.attention import AttentionMetadata, PagedAttention
from kvserve.model.layers.linear import linear, onednn_pack
from kvserve.model.layers.rotary import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 then cast back, as the reference does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, hd = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.q_size, self.kv_size = arch.num_heads * hd, arch.num_kv_heads * hd
        self.eps = arch.rms_norm_eps
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size), requires_grad=False)
            if arch.attention_bias
            else None
        )
        self.o_weight = nn.Parameter(torch.empty(h, self.q_size), requires_grad=False)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * arch.intermediate_size, h), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(h, arch.intermediate_size), requires_grad=False)
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, hd)
        self.packed: dict[str, torch.Tensor | None] = {}  # oneDNN-packed weights, see pack_weights

    def pack_weights(self) -> None:
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            self.packed[name] = onednn_pack(getattr(self, name))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        p = self.packed
        qkv = linear(h, self.qkv_weight, self.qkv_bias, p.get("qkv_weight"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
        x = x + linear(attn.reshape(n, self.q_size), self.o_weight, None, p.get("o_weight"))
        h = rms_norm(x, self.post_attn_norm, self.eps)
        gate, up = linear(h, self.gate_up_weight, None, p.get("gate_up_weight")).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down_weight, None, p.get("down_weight"))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.empty(arch.hidden_size), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if arch.tie_word_embeddings
            else nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        )
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.lm_head_packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Prepack every projection for oneDNN (CPU); a no-op elsewhere."""
        for layer in self.layers:
            layer.pack_weights()
        self.lm_head_packed = onednn_pack(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    ) -> torch.Tensor:
        """Final hidden states (after the last norm) for every input token."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head, None, self.lm_head_packed).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        pending: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        dtype = self.embed_tokens.dtype
        for name, tensor in weights:
            tensor = tensor.to(dtype)
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m:
                idx, rest = int(m.group(1)), m.group(2)
                if rest.endswith("rotary_emb.inv_freq"):
                    continue
                pending.setdefault(idx, {})[rest] = tensor
                self._maybe_finish_layer(idx, pending)
                continue
            if name == "model.embed_tokens.weight":
                self.embed_tokens.data = tensor
                if self.arch.tie_word_embeddings:
                    self.lm_head = self.embed_tokens
            elif name == "model.norm.weight":
                self.norm.data = tensor
            elif name == "lm_head.weight":
                if not self.arch.tie_word_embeddings:
                    self.lm_head.data = tensor
            else:
                raise ValueError(f"unexpected weight {name!r}")
            seen.add(name)
        if pending:
            missing = {i: sorted(p) for i, p in pending.items()}
            raise ValueError(f"incomplete layer weights: {missing}")
        need = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.arch.tie_word_embeddings:
            need.add("lm_head.weight")
        if need - seen:
            raise ValueError(f"missing weights: {sorted(need - seen)}")

    _LAYER_KEYS = (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    _BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

    def _maybe_finish_layer(self, idx: int, pending: dict[int, dict[str, torch.Tensor]]) -> None:
        p = pending[idx]
        keys = self._LAYER_KEYS + (self._BIAS_KEYS if self.arch.attention_bias else ())
        if not all(k in p for k in keys):
            return
        layer: DecoderLayer = self.layers[idx]
        layer.qkv_weight.data = torch.cat(
            [p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"], p["self_attn.v_proj.weight"]]
        )
        if self.arch.attention_bias:
            layer.qkv_bias.data = torch.cat(
                [p["self_attn.q_proj.bias"], p["self_attn.k_proj.bias"], p["self_attn.v_proj.bias"]]
            )
        layer.o_weight.data = p["self_attn.o_proj.weight"]
        layer.gate_up_weight.data = torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]])
        layer.down_weight.data = p["mlp.down_proj.weight"]
        layer.input_norm.data = p["input_layernorm.weight"]
        layer.post_attn_norm.data = p["post_attention_layernorm.weight"]
        del pending[idx]
