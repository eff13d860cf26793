"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Takes flat token tensors (all requests of a step concatenated) and knows nothing about
scheduling. q/k/v and gate/up projections are fused into single matmuls at load time.

With `quantization` set, each projection is quantized as its layer completes during loading
(so the float copy of the whole model never exists) and runs through QuantizedLinear. The
embedding table and lm_head use int8 (fp8 under `fp8`), also under int4: the output layer is
the most sensitive to rounding, and a tied table must also serve row lookups.
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
from kvserve.model.layers.quantization import QWeight, fuse, quantize_weight
from kvserve.model.layers.quantized_linear import QuantizedLinear
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
        self.quant = nn.ModuleDict()  # projection name -> QuantizedLinear (its float weight is empty)

    def pack_weights(self) -> None:
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            if name not in self.quant:
                self.packed[name] = onednn_pack(getattr(self, name))

    def set_weight(self, name: str, w: torch.Tensor | QWeight, device: torch.device | str) -> None:
        """A float weight goes into its Parameter; a quantized one into a QuantizedLinear."""
        param = getattr(self, name)
        if isinstance(w, QWeight):
            self.quant[name] = QuantizedLinear(w, device)
            param.data = torch.empty(0, dtype=param.dtype)
        else:
            param.data = w

    def proj(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if name in self.quant:
            return self.quant[name](x, bias)
        return linear(x, getattr(self, name), bias, self.packed.get(name))

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
        qkv = self.proj("qkv_weight", h, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
        x = x + self.proj("o_weight", attn.reshape(n, self.q_size))
        h = rms_norm(x, self.post_attn_norm, self.eps)
        gate, up = self.proj("gate_up_weight", h).chunk(2, dim=-1)
        return x + self.proj("down_weight", F.silu(gate) * up)


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
        self.quantization: str | None = None  # set by the loader before load_weights
        self.quant_device: torch.device | str = "cpu"  # the device quantized weights are packed for
        self.embed_q: QuantizedLinear | None = None  # quantized table (lookups) and lm_head
        self.lm_head_q: QuantizedLinear | None = None

    def weight_bytes(self) -> int:
        """Bytes of the weights: parameters and persistent buffers, a tied table counted once
        (rotary tables and oneDNN's packed copies are not included)."""
        tensors = {id(t): t for t in self.state_dict(keep_vars=True).values()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def pack_weights(self) -> None:
        """Prepack every float projection for oneDNN (CPU); a no-op elsewhere."""
        for layer in self.layers:
            layer.pack_weights()
        if self.lm_head_q is None:
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
        if self.embed_q is not None:
            x = self.embed_q.embedding(input_ids, self.norm.dtype)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_q is not None:
            return self.lm_head_q(hidden).float()
        return linear(hidden, self.lm_head, None, self.lm_head_packed).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        pending: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        dtype = self.embed_tokens.dtype
        for name, tensor in weights:
            if isinstance(tensor, QWeight) and not name.startswith("model.layers."):
                tensor = tensor.dequantize()
            if isinstance(tensor, torch.Tensor):
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
        if self.quantization is not None:
            self._quantize_embeddings()

    def _quantize_embeddings(self) -> None:
        method = "fp8" if self.quantization == "fp8" else "int8"
        self.embed_q = QuantizedLinear(quantize_weight(self.embed_tokens, method), self.quant_device)
        if self.arch.tie_word_embeddings:
            self.lm_head_q = self.embed_q
        else:
            self.lm_head_q = QuantizedLinear(quantize_weight(self.lm_head, method), self.quant_device)
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        self.embed_tokens.data = torch.empty(0, dtype=self.embed_tokens.dtype)

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
        method, dev = self.quantization, self.quant_device
        qkv = [p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"], p["self_attn.v_proj.weight"]]
        layer.set_weight("qkv_weight", fuse(qkv, method), dev)
        layer.set_weight("o_weight", fuse([p["self_attn.o_proj.weight"]], method), dev)
        gate_up = [p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]]
        layer.set_weight("gate_up_weight", fuse(gate_up, method), dev)
        layer.set_weight("down_weight", fuse([p["mlp.down_proj.weight"]], method), dev)
        if self.arch.attention_bias:
            layer.qkv_bias.data = torch.cat(
                [p["self_attn.q_proj.bias"], p["self_attn.k_proj.bias"], p["self_attn.v_proj.bias"]]
            )
        layer.input_norm.data = p["input_layernorm.weight"]
        layer.post_attn_norm.data = p["post_attention_layernorm.weight"]
        del pending[idx]
